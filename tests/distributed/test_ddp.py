"""DDP on 2 CPU processes (gloo, loopback) against the single-process run."""

from __future__ import annotations

import json

import pytest
import torch

from sailfin import Trainer
from sailfin.config import ConfigError, TrainerArguments
from sailfin.data import BatchPlan
from sailfin.distributed import DistEnv
from tests.distributed.harness import errors, run_ranks
from tests.distributed.workers import train
from tests.recipes import IdData, LinearRecipe, args


def single(tmp_path, data, trainer, recipe=None):
    module = LinearRecipe(IdData(**data), **(recipe or {}))
    Trainer(module, args(tmp_path / "sp", **trainer)).train()
    return module


def ddp(tmp_path, data, trainer, recipe=None, kind="linear", world=2):
    out = tmp_path / "ddp"
    out.mkdir()
    codes = run_ranks(train, world, out, data=data, trainer=trainer, recipe=recipe, kind=kind)
    assert codes == [0] * world, errors(out)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def test_same_global_batch_as_one_process(tmp_path):
    """2 processes x micro 16 x accumulation 2 == one process with micro 64."""
    data = {"n_train": 200, "n_val": 0}
    recipe = {"momentum": 0.9}
    ref = single(tmp_path, data, {"epochs": 2, "train_batch_size": 64, "micro_batch_size": 64},
                 recipe)
    ranks = ddp(tmp_path, data, {"epochs": 2, "train_batch_size": 64, "micro_batch_size": 16},
                recipe)
    # Step k sees the same samples: rank 0's part, then rank 1's.
    assert [a + b for a, b in zip(ranks[0]["step_ids"], ranks[1]["step_ids"])] == ref.step_ids
    assert ranks[0]["summary"]["global_step"] == 8
    assert ranks[0]["summary"]["world_size"] == 2
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(ranks[0]["params"][key], value, rtol=1e-5, atol=1e-6)
    # Ranks agree on every parameter after every step.
    assert len(ranks[0]["trace"]) == 8
    for a, b in zip(ranks[0]["trace"], ranks[1]["trace"]):
        assert torch.equal(a, b)
    # no_sync: one all-reduce per step (one bucket), not one per micro-batch.
    assert ranks[0]["allreduce_calls"] == ranks[1]["allreduce_calls"] == 8
    assert ranks[0]["threads"] == 1


def test_uneven_data_exactly_once_and_exact_validation(tmp_path):
    """103 samples, global 12 over 2 ranks x micro 3: the last step (7 samples) splits
    4 + 3, so rank 0 runs micro-batches [3, 1] and rank 1 runs [3] and a weight-0 padding
    sample: no hang, and every sample once."""
    data = {"n_train": 103, "n_val": 31}
    trainer = {"epochs": 2, "train_batch_size": 12, "micro_batch_size": 3}
    ref = single(tmp_path, data, {**trainer, "micro_batch_size": 12})
    ranks = ddp(tmp_path, data, trainer)
    for epoch in range(2):
        steps = slice(epoch * 9, (epoch + 1) * 9)
        ids = [i for r in ranks for step in r["step_ids"][steps] for i in step]
        assert sorted(ids) == list(range(103))  # each sample once per epoch
    assert ranks[0]["step_ids"][8] and len(ranks[0]["step_ids"][8]) == 4
    assert len(ranks[1]["step_ids"][8]) == 3
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(ranks[1]["params"][key], value, rtol=1e-5, atol=1e-6)
    # Validation: every sample once, dataset order, metrics as one process computes them.
    ref_mse = json.loads((tmp_path / "sp" / "summary.json").read_text())["val"]["mse"]
    for r in ranks:
        val = [e for e in r["events"] if e[0] == "val"]
        assert [e[3] for e in val] == [list(range(31))] * 3  # 2 epochs + validate()
        assert r["val"]["val"]["count"] == r["summary"]["val"]["count"] == 31
        assert r["val"]["val"]["mse"] == pytest.approx(ref_mse, rel=1e-5)
    # Only rank 0 writes.
    run = tmp_path / "ddp" / "run"
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len([x for x in lines if '"split": "train"' in x]) == 18  # log every step, once
    assert (run / "final" / "model.safetensors").exists()


def test_more_ranks_than_samples_in_the_last_step(tmp_path):
    """21 samples, global 10, 2 ranks x micro 5: the last step has 1 sample; rank 1 runs a
    weight-0 padding micro-batch so the all-reduce still matches, and the result is exact."""
    data = {"n_train": 21, "n_val": 3}
    trainer = {"epochs": 1, "train_batch_size": 10, "micro_batch_size": 5}
    ref = single(tmp_path, data, {**trainer, "micro_batch_size": 10})
    ranks = ddp(tmp_path, data, trainer)
    assert ranks[0]["step_ids"][2] == ref.step_ids[2] and len(ref.step_ids[2]) == 1
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(ranks[1]["params"][key], value, rtol=1e-5, atol=1e-6)
    assert ranks[1]["val"]["val"]["count"] == 3


def test_train_step_with_its_own_collective_meets_its_partners(tmp_path):
    """A collective on every forward (a contrastive loss's all-gather, SyncBatchNorm) needs
    the same forwards on every rank. The last step of an epoch of 57 samples (9 = 5 + 4,
    micro 4) runs [4, 1] on rank 0 and [4, padding] on rank 1."""
    plan = BatchPlan.create(16, 4, 2)
    assert [m.padding for m in plan.micro_batches(3, 57, 1)] == [False, True]
    data = {"n_train": 57, "n_val": 0}
    trainer = {"epochs": 2, "train_batch_size": 16, "micro_batch_size": 4}
    ref = single(tmp_path, data, {**trainer, "micro_batch_size": 16})
    ranks = ddp(tmp_path, data, trainer, kind="collective")
    for r in ranks:
        forwards = [e[2] for e in r["events"] if e[0] == "forward_samples"]
        assert forwards == ([8.0] * 6 + [8.0, 2.0]) * 2  # both ranks in every forward
        assert r["summary"]["global_step"] == 8
    ids = [i for r in ranks for step in r["step_ids"][:4] for i in step]
    assert sorted(ids) == list(range(57))  # the padding sample is not a sample seen
    for key, value in ref.state_dict().items():  # weight 0: the gradient is unchanged
        torch.testing.assert_close(ranks[1]["params"][key], value, rtol=1e-5, atol=1e-6)
    # With drop_last the short step goes, and with it the padding.
    (tmp_path / "drop").mkdir()
    ranks = ddp(tmp_path / "drop", data, {**trainer, "drop_last": True}, kind="collective")
    assert [e[2] for e in ranks[0]["events"] if e[0] == "forward_samples"] == [8.0] * 12


def test_ddp_amp_composes_ddp_with_mixed_precision(tmp_path):
    """ddp-amp (bf16 on CPU) over 2 processes lands where sp-amp does with one."""
    data = {"n_train": 64, "n_val": 0}
    trainer = {"epochs": 2, "train_batch_size": 16, "micro_batch_size": 8}
    ref = single(tmp_path, data, {**trainer, "micro_batch_size": 16, "backend": "sp-amp"})
    ranks = ddp(tmp_path, data, {**trainer, "backend": "ddp-amp"})
    assert ranks[0]["summary"]["global_step"] == 8
    for a, b in zip(ranks[0]["trace"], ranks[1]["trace"]):
        assert torch.equal(a, b)
    for key, value in ref.state_dict().items():  # bf16 rounding differs with the batch split
        torch.testing.assert_close(ranks[0]["params"][key], value, rtol=0.05, atol=0.02)


def test_non_tensor_validation_outputs_are_gathered_in_order(tmp_path):
    data = {"n_train": 20, "n_val": 11}
    trainer = {"epochs": 1, "train_batch_size": 10, "micro_batch_size": 5,
               "val_batch_size": 4}
    ranks = ddp(tmp_path, data, trainer, kind="named")
    for r in ranks:
        names = [e[1] for e in r["events"] if e[0] == "names"]
        assert names[-1] == [f"s{i}" for i in range(11)]


def test_one_rank_failing_ends_the_job_with_its_error(tmp_path):
    out = tmp_path / "fail"
    out.mkdir()
    codes = run_ranks(train, 2, out, timeout=90, data={"n_train": 100, "n_val": 0},
                      trainer={"epochs": 1, "train_batch_size": 10, "micro_batch_size": 5},
                      recipe={"fail_rank": 1, "fail_step": 3}, kind="failing")
    assert codes[1] != 0 and codes[0] != 0  # rank 0 does not wait forever
    errs = errors(out)
    assert "recipe failed on purpose at step 3" in errs[1]


def test_ddp_without_a_launcher_shows_the_torchrun_command(tmp_path):
    with pytest.raises(ConfigError, match=r"torchrun --nproc-per-node=\d+ .*--trainer.backend"):
        Trainer(LinearRecipe(IdData(10, 0)), args(tmp_path, backend="ddp"), dist=DistEnv())


LAUNCHED = {"torchrun": {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                         "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                         "MASTER_PORT": "29500"},
            "slurm": {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
                      "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "node1",
                      "SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "train"}}


@pytest.mark.parametrize("launcher", LAUNCHED)
def test_the_default_backend_is_ddp_under_a_launcher_of_several_processes(
        tmp_path, monkeypatch, launcher):
    """No trainer.backend in the config: under torchrun or Slurm with world size 2 the run
    is data parallel (as HF Trainer, Accelerate and Lightning do), alone it is sp; an
    explicit sp keeps its refusal."""
    from sailfin.backends.ddp import DDPStrategy

    assert TrainerArguments().backend == "auto"
    for key, value in LAUNCHED[launcher].items():
        monkeypatch.setenv(key, value)
    trainer = Trainer(LinearRecipe(IdData(10, 0)), args(tmp_path))
    assert trainer.dist.world_size == 2 and trainer.dist.launcher == launcher
    assert trainer.args.backend == "ddp" and isinstance(trainer.backend, DDPStrategy)
    with pytest.raises(ConfigError, match="rank 1 of 2.*every rank would train alone"):
        Trainer(LinearRecipe(IdData(10, 0)), args(tmp_path, backend="sp"))
    # One process of a launcher (world size 1): the single-device backend.
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("SLURM_PROCID", "0")
    alone = Trainer(LinearRecipe(IdData(10, 0)), args(tmp_path))
    assert alone.args.backend == "sp" and not isinstance(alone.backend, DDPStrategy)


def test_single_process_backend_refuses_a_multi_rank_job(tmp_path):
    dist = DistEnv(rank=1, world_size=2, local_rank=1, local_world_size=2, launcher="torchrun")
    with pytest.raises(ConfigError, match="rank 1 of 2.*Use trainer.backend ddp"):
        Trainer(LinearRecipe(IdData(10, 0)), args(tmp_path, backend="sp"), dist=dist)


@pytest.mark.slow
def test_ema_under_ddp_equals_one_process(tmp_path):
    """Ranks keep equal parameters, so their averages are equal (no communication) and
    equal to one process's average over the same global batches."""
    from safetensors.torch import load_file

    data = {"n_train": 96, "n_val": 0}
    trainer = {"epochs": 2, "train_batch_size": 16, "ema": {"decay": 0.8, "every_n_steps": 2}}
    single(tmp_path, data, {**trainer, "micro_batch_size": 16})
    ranks = ddp(tmp_path, data, {**trainer, "micro_batch_size": 4})
    want = load_file(str(tmp_path / "sp" / "final" / "ema.safetensors"))
    for name, value in want.items():
        a, b = ranks[0]["ema"]["shadow"][name], ranks[1]["ema"]["shadow"][name]
        assert torch.equal(a, b)
        torch.testing.assert_close(a, value, rtol=1e-5, atol=1e-6)
    saved = load_file(str(tmp_path / "ddp" / "run" / "final" / "ema.safetensors"))
    assert set(saved) == set(want)
    assert ranks[0]["ema"]["updates"] == 6
