"""Every user error ends as one message naming the file, key or offset, with exit code 2."""

import json

import pytest
import torch

from sailfin.cli import main
from tests.data.shards.helpers import write_shards
from tests.recipes import LinearRecipe

BASE = """
data: {class_path: tests.recipes.IdData, init_args: {n_train: 20, n_val: 4}}
module: {class_path: tests.recipes.LinearRecipe}
trainer: {epochs: 1, train_batch_size: 10, writers: [jsonl], output_dir: OUT}
"""


def run(tmp_path, capsys, text=BASE, *overrides, data=None):
    path = tmp_path / "run.yaml"
    if data is None:
        path.write_text(text.replace("OUT", str(tmp_path / "out")))
    else:
        path.write_bytes(data)
    code = main(["train", str(path), *overrides])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err, path


def test_class_path_must_name_a_class_of_the_interface_before_it_is_called(tmp_path, capsys):
    marker = tmp_path / "X"
    code, err, _ = run(tmp_path, capsys, BASE, "--data.class_path", "subprocess.getoutput",
                       "--data.init_args", f'{{cmd: "touch {marker}"}}')
    assert code == 2 and not marker.exists()
    assert ("data.class_path must name a subclass of sailfin.DataInterface; "
            "subprocess.getoutput is a function, not a class") in err
    code, err, _ = run(tmp_path, capsys, BASE, "--module.class_path", "collections.Counter")
    assert code == 2
    assert ("module.class_path must name a subclass of sailfin.ModuleInterface; "
            "collections.Counter is a class that does not derive from it") in err


def test_a_key_given_twice_names_the_key_and_both_lines(tmp_path, capsys):
    text = BASE.replace("trainer: {", "trainer: {seed: 1, seed: 2, ")
    code, err, path = run(tmp_path, capsys, text)
    assert code == 2 and f"config file {path}: key 'seed' is given twice" in err
    text = BASE + "module: {class_path: tests.recipes.LinearRecipe}\n"
    code, err, _ = run(tmp_path, capsys, text)
    assert code == 2 and "key 'module' is given twice in one mapping (lines 3 and 5)" in err


def test_a_byte_that_is_not_utf8_names_the_file(tmp_path, capsys):
    data = BASE.replace("OUT", str(tmp_path / "out")).encode().replace(b"epochs", b"ep\xffochs")
    code, err, path = run(tmp_path, capsys, data=data)
    assert code == 2
    assert f"config file {path} is not UTF-8 text: byte 0xff at offset" in err and "line 4" in err


def test_a_negative_seed_is_a_config_error(tmp_path, capsys):
    code, err, _ = run(tmp_path, capsys, BASE, "--trainer.seed", "-1")
    assert code == 2 and "trainer.seed must be between 0 and 4294967295, got -1" in err


SHARDS = """
data: {class_path: tests.data.shards.helpers.ShardIdData, init_args: {urls: "URLS"}}
module: {class_path: tests.recipes.LinearRecipe}
trainer: {epochs: 1, train_batch_size: 4, writers: [jsonl], output_dir: OUT, val_every_n_epochs: 0}
"""


def test_shard_errors_are_messages(tmp_path, capsys):
    paths = write_shards(tmp_path / "shards", [4, 4])
    text = SHARDS.replace("URLS", f"pipe:cat {paths[0]}")
    code, err, _ = run(tmp_path, capsys, text)
    assert code == 2 and "sailfin: shard error: refusing shard URL 'pipe:cat" in err
    # A changed byte found while training.
    offset = json.loads(open(paths[1] + ".idx").read())["offsets"][1] + 130  # a float's byte
    with open(paths[1], "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))
    text = SHARDS.replace("URLS", str(tmp_path / "shards"))
    code, err, _ = run(tmp_path, capsys, text)
    assert code == 2 and f"sailfin: shard error: shard {paths[1]}, sample" in err
    assert "does not match its CRC-32" in err


def test_an_index_with_out_of_order_offsets_names_it(tmp_path, capsys):
    paths = write_shards(tmp_path / "shards", [4])
    doc = json.loads(open(paths[0] + ".idx").read())
    doc["offsets"] = doc["offsets"][::-1]
    open(paths[0] + ".idx", "w").write(json.dumps(doc))
    code, err, _ = run(tmp_path, capsys, SHARDS.replace("URLS", paths[0]))
    assert code == 2 and f"shard error: shard index {paths[0]}.idx is unreadable" in err
    assert "out of order" in err


def test_a_worker_error_keeps_only_its_own_message():
    from sailfin.cli import _without_worker_traceback
    from sailfin.data import ShardError

    text = ("Caught ShardError in DataLoader worker process 0.\nOriginal Traceback (most "
            "recent call last):\n  File \"x.py\", line 1, in f\n    g()\n"
            "sailfin.data.shards.errors.ShardError: shard a.tar, sample '7' at byte 512: bad\n")
    assert _without_worker_traceback(ShardError(text)) == "shard a.tar, sample '7' at byte 512: bad"
    assert _without_worker_traceback(ShardError("plain")) == "plain"


def test_a_user_error_is_printed_by_rank_0_only(tmp_path, monkeypatch, capsys):
    """(#28) Every rank under torchrun meets the same config error: rank 1 is silent."""
    from sailfin.cli import main
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("trainer: {epochz: 2}\n")
    for rank, says in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert main(["train", str(cfg)]) == 2
        err = capsys.readouterr().err
        assert ("sailfin: config error: " in err) is says, err


@pytest.mark.slow
def test_a_user_error_under_torchrun_is_printed_once(tmp_path):
    import subprocess
    import sys
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("trainer: {epochz: 2}\n")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "2", "-m", "sailfin", "train", str(cfg)], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0
    assert proc.stderr.count("trainer.epochz") == 1, proc.stderr


class NoSamplerRecipe(LinearRecipe):
    """Builds its loader with its own sampler, not sailfin's: a recipe mistake."""

    def get_train_dataloader(self, sampler, batch_size):
        ds = self.data.get_train_dataset()
        return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=True)


class NoOptimizerRecipe(LinearRecipe):
    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [], []


class WrongBatchRecipe(LinearRecipe):
    def get_train_dataloader(self, sampler, batch_size):
        ds = self.data.get_train_dataset()
        return torch.utils.data.DataLoader(ds, batch_size=batch_size + 1, sampler=sampler(ds))


@pytest.mark.parametrize("recipe, says", [
    ("NoSamplerRecipe", "get_train_dataloader did not call sampler(dataset): build the loader "
                        "with DataLoader(dataset, batch_size=batch_size, "
                        "sampler=sampler(dataset))"),
    ("NoOptimizerRecipe", "get_optimizers_schedulers returned no optimizer"),
    ("WrongBatchRecipe", "get_train_dataloader must use batch_size=10 (the batch_size "
                         "argument) and drop_last=False; got batch_size=11"),
])
def test_a_recipe_mistake_found_while_building_the_run_is_one_line_before_step_1(
        tmp_path, capsys, recipe, says):
    code, err, _ = run(tmp_path, capsys, BASE, "--module.class_path",
                       f"tests.test_cli_errors.{recipe}")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"sailfin: recipe error: {says}"), err
    # before step 1: no metrics, no checkpoint, no summary
    out = tmp_path / "out"
    assert not (out / "summary.json").exists() and not (out / "checkpoints").exists()
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text()


def test_a_partial_save_removed_under_a_rank_is_told_apart(tmp_path):
    """A rank whose save file's directory vanished (another rank's failed save removed the
    shared partial) is an echo of that failure; any other write error is its own."""
    import errno

    from sailfin.checkpoint.errors import CheckpointWriteError
    from sailfin.cli import _staging_removed_under_us

    gone = str(tmp_path / ".tmp-step-00000002" / "shards" / "__1_0.distcp")
    assert _staging_removed_under_us(CheckpointWriteError("x", gone, errno.ENOENT))
    (tmp_path / "kept").mkdir()
    here = str(tmp_path / "kept" / "__1_0.distcp")
    assert not _staging_removed_under_us(CheckpointWriteError("x", here, errno.ENOENT))
    assert not _staging_removed_under_us(CheckpointWriteError("x", gone, errno.ENOSPC))
    assert not _staging_removed_under_us(OSError(errno.ENOENT, "gone"))
