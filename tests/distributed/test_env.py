import pytest

from sailfin.config import ConfigError, load_config
from sailfin.config.distributed import DistArguments
from sailfin.distributed import DistEnv
from sailfin.distributed.env import first_host


def test_no_launcher_is_rank_0_of_1():
    env = DistEnv.from_environ({})
    assert (env.rank, env.world_size, env.launched) == (0, 1, False)


def test_torchrun_variables():
    env = DistEnv.from_environ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h0",
                                "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "2"})
    assert env == DistEnv(3, 4, 1, 2, "torchrun", "h0", 29500, 2)


def test_slurm_variables():
    env = DistEnv.from_environ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                                "SLURM_TASKS_PER_NODE": "4(x2)",
                                "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "1234"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert env.launcher == "slurm" and env.master_addr == "gpu07"
    assert env.master_port == 15000 + 1234  # the same on every task of the job


def test_torchrun_inside_slurm_wins():
    env = DistEnv.from_environ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "RANK": "1",
                                "WORLD_SIZE": "2"})
    assert env.launcher == "torchrun" and env.rank == 1


def test_open_mpi_and_azure_ml_master():
    env = DistEnv.from_environ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                                "AZ_BATCH_MASTER_NODE": "10.0.0.4:6105"})
    assert env == DistEnv(1, 2, 1, 2, "mpi", "10.0.0.4", 6105)


def test_mpich_variables():
    env = DistEnv.from_environ({"PMI_RANK": "2", "PMI_SIZE": "3", "MASTER_ADDR": "a",
                                "MASTER_PORT": "1"})
    assert (env.rank, env.world_size, env.launcher) == (2, 3, "mpi")


def test_manual_config():
    args = DistArguments(launcher="manual", rank=1, world_size=2, master_addr="x",
                         master_port=29400)
    env = DistEnv.from_config(args, {})
    assert (env.rank, env.world_size, env.launcher, env.master_port) == (1, 2, "manual", 29400)


def test_config_disagreeing_with_the_launcher_is_an_error():
    with pytest.raises(ConfigError, match="world_size=4 disagrees with the torchrun"):
        DistEnv.from_config(DistArguments(world_size=4), {"RANK": "0", "WORLD_SIZE": "2"})


def test_config_fills_what_the_launcher_left_out():
    env = DistEnv.from_config(DistArguments(master_addr="h", master_port=7),
                              {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})
    assert (env.master_addr, env.master_port) == ("h", 7)


def test_named_launcher_without_its_variables():
    with pytest.raises(ConfigError, match="launcher is 'slurm' but its variables are not set"):
        DistEnv.from_config(DistArguments(launcher="slurm"), {})


def test_bad_values_name_the_variable():
    with pytest.raises(ConfigError, match="RANK='x' is not an integer"):
        DistEnv.from_environ({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="rank 2 is outside world size 2"):
        DistEnv.from_environ({"RANK": "2", "WORLD_SIZE": "2"})


def test_manual_launcher_needs_its_values(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("module: {class_path: x.Y}\ntrainer: {distributed: {launcher: manual, rank: 0}}\n")
    with pytest.raises(ConfigError, match="trainer.distributed.world_size, .*master_addr"):
        load_config(cfg)
    with pytest.raises(ConfigError, match="unknown config key 'trainer.distributed.rnak'"
                                          ".*did you mean 'rank'"):
        load_config(cfg, ["--trainer.distributed.rnak", "1"])


@pytest.mark.parametrize("nodelist, host", [("node1", "node1"), ("gpu[03-05,07],cpu1", "gpu03"),
                                            ("a,b", "a"), ("", "")])
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host
