"""The bad-input table: inputs that once ended in a traceback, each with what must happen now.

Every row runs ``sailfin train`` in-process and checks the exit code, that no
traceback was printed, the one line that names the input, and, for damaged
checkpoints, the effect: the resume fell back to the older checkpoint and
saved the damaged step again.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import typing

import pytest

from sailfin.cli import main
from sailfin.config import ConfigError, TrainerArguments, load_config
from sailfin.checkpoint.manifest import seal

BASE = """
data: {class_path: tests.recipes.IdData, init_args: {n_train: 20, n_val: 4}}
module: {class_path: tests.recipes.LinearRecipe}
trainer: {epochs: 1, train_batch_size: 10, writers: [jsonl], output_dir: OUT,
          checkpoint: {every_n_steps: 1}}
"""
HUGE = str(10 ** 30)


def _run(tmp_path, capsys, *overrides, extra=""):
    path = tmp_path / "run.yaml"
    path.write_text(BASE.replace("OUT", str(tmp_path / "out")) + extra)
    code = main(["train", str(path), *overrides])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


def _nested(levels: int) -> str:
    return "x: " + "[" * levels + "1" + "]" * levels + "\n"


def _aliased(width: int = 20, levels: int = 5) -> str:
    """``levels`` anchored lists, each ``width`` aliases of the one before: width**levels
    values written out (3.2 million), from a few hundred bytes of YAML."""
    items = [f"l0: &l0 [{', '.join(['12345'] * width)}]"]
    items += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "x: {" + ", ".join(items) + "}\n"


def _two_saves_then(damage):
    """Train 2 steps (saves step 1 and 2), then damage step 2 with ``damage(step_dir)``."""
    def setup(tmp_path, capsys):
        assert _run(tmp_path, capsys)[0] == 0
        damage(tmp_path / "out" / "checkpoints" / "step-00000002")
    return setup


def _shard_is_a_directory(step):
    """The shard file (model, optimizers and small state) replaced by a directory."""
    (step / "shards" / "__0_0.distcp").unlink()
    (step / "shards" / "__0_0.distcp").mkdir()


def _manifest_step_is_x(step):
    doc = json.loads((step / "manifest.json").read_text())
    doc["step"] = "x"
    (step / "manifest.json").write_bytes(seal(doc))


def _memory_dir_is_a_file(tmp_path, capsys):
    (tmp_path / "memfile").write_text("not a directory")


def _checkpoints_is_a_file(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "checkpoints").write_text("not a directory")


# (name, setup before the run, overrides, extra YAML, exit code, text stderr must hold)
TABLE = [
    ("train_batch_size 10**30", None, ["--trainer.train_batch_size", HUGE], "", 2,
     f"config key 'trainer.train_batch_size' got {HUGE}, which is out of range"),
    ("val_batch_size 10**30", None, ["--trainer.val_batch_size", HUGE], "", 2,
     f"config key 'trainer.val_batch_size' got {HUGE}, which is out of range"),
    ("YAML nested 5,000 levels", None, [], _nested(5000), 2,
     "nests values more than 100 levels deep"),
    ("YAML nested 150 levels (loads, still refused)", None, [], _nested(150), 2,
     "nests values more than 100 levels deep"),
    ("YAML aliases writing out past 4 MiB", None, [], _aliased(), 2,
     "takes more than 4 MiB written out (its YAML aliases (*name) expanded)"),
    ("a dotted override 101 levels deep", None,
     ["--module.init_args." + ".".join(["a"] * 101), "1"], "", 2,
     "nests values more than 100 levels deep"),
    ("module.class_path: sailfin.ModuleInterface", None,
     ["--module.class_path", "sailfin.ModuleInterface"], "", 2,
     "module.class_path names sailfin.ModuleInterface itself"),
    ("data.class_path: sailfin.DataInterface", None,
     ["--data.class_path", "sailfin.DataInterface"], "", 2,
     "data.class_path names sailfin.DataInterface itself"),
    ("max_grad_norm: .nan", None, ["--trainer.max_grad_norm", ".nan"], "", 2,
     "config key 'trainer.max_grad_norm' got nan; expected a finite number"),
    ("checkpoints is a file", _checkpoints_is_a_file, [], "", 2,
     "is a file, not a directory"),
    ("manifest step 'x', resume: that checkpoint",
     _two_saves_then(_manifest_step_is_x), ["--trainer.resume", "STEP2"], "", 2,
     "has step 'x', not a count (an integer >= 0): it is damaged"),
    ("the shard file a directory, resume: that checkpoint",
     _two_saves_then(_shard_is_a_directory), ["--trainer.resume", "STEP2"], "", 2,
     "shards/__0_0.distcp is a directory, not a regular file"),
    ("manifest step 'x', resume: auto falls back",
     _two_saves_then(_manifest_step_is_x), [], "", 0,
     "skipped damaged checkpoint(s) step-00000002; falling back to"),
    ("the shard file a directory, resume: auto falls back",
     _two_saves_then(_shard_is_a_directory), [], "", 0,
     "skipped damaged checkpoint(s) step-00000002; falling back to"),
    ("output_dir with a NUL byte", None, ["--trainer.output_dir", "TMP/o\0ut"], "", 2,
     "config key 'trainer.output_dir' got"),
    ("memory.dir a regular file", _memory_dir_is_a_file,
     ["--trainer.checkpoint.memory.every_n_steps", "1",
      "--trainer.checkpoint.memory.dir", "TMP/memfile"], "", 2,
     "memfile is a file, not a directory; change trainer.checkpoint.memory.dir"),
    ("an empty training set", None, ["--data.init_args.n_train", "0"], "", 2,
     "sailfin: config error: the training set is empty"),
]


@pytest.mark.parametrize("name,setup,overrides,extra,code,text", TABLE,
                         ids=[row[0] for row in TABLE])
def test_bad_input(tmp_path, capsys, name, setup, overrides, extra, code, text):
    if setup is not None:
        setup(tmp_path, capsys)
    step2 = tmp_path / "out" / "checkpoints" / "step-00000002"
    overrides = [str(step2) if o == "STEP2" else o.replace("TMP", str(tmp_path))
                 for o in overrides]
    got, err = _run(tmp_path, capsys, *overrides, extra=extra)
    assert got == code, err
    assert text in err
    lines = [line for line in err.splitlines()
             if line.startswith("sailfin: ") and ("error" in line or "cannot" in line)]
    if code == 2:
        assert len(lines) == 1, err  # one line, naming the input
        if setup is None:  # refused before the first step: nothing was trained
            assert not (tmp_path / "out" / "checkpoints").exists()
    else:  # fell back to step 1, trained step 2 again and saved it whole
        assert "step-00000001, the newest complete one" in err
        manifest = json.loads((step2 / "manifest.json").read_text())
        assert manifest["step"] == 2 and (step2 / "shards" / "__0_0.distcp").is_file()


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory no one can write in: a read-only tmpfs as root, a 0555 directory else."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_read_only_memory_dir_is_one_line_and_exit_2(tmp_path, capsys, read_only_dir):
    code, err = _run(tmp_path, capsys, "--trainer.checkpoint.memory.every_n_steps", "1",
                     "--trainer.checkpoint.memory.dir", str(read_only_dir / "snapshots"))
    assert code == 2, err
    assert err.splitlines() == [
        f"sailfin: memory snapshots (trainer.checkpoint.memory) cannot write to "
        f"{read_only_dir / 'snapshots'}: "
        + ("Read-only file system" if os.geteuid() == 0 else "Permission denied")
        + "; fix the path or free space on its disk, or change trainer.checkpoint.memory.dir"]
    assert not (tmp_path / "out" / "checkpoints").exists()  # before the first step


def _float_options(cls=TrainerArguments, prefix="trainer."):
    """Every dotted option of the schema whose type admits a float."""
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        args = typing.get_args(tp) or (tp,)
        if dataclasses.is_dataclass(tp):
            yield from _float_options(tp, f"{prefix}{f.name}.")
        elif float in args:
            yield prefix + f.name


FLOAT_OPTIONS = sorted(_float_options())


def test_the_schema_has_the_float_options_this_table_expects():
    # A float option added later is covered by the test below on its own.
    assert {"trainer.max_grad_norm", "trainer.progress_interval", "trainer.peak_tflops",
            "trainer.distributed.timeout_seconds", "trainer.distributed.hang_seconds",
            "trainer.early_stopping.min_delta", "trainer.ema.decay"} <= set(FLOAT_OPTIONS)


@pytest.mark.parametrize("key", FLOAT_OPTIONS)
@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "nan", "inf", "1e400"])
def test_every_float_option_refuses_nan_and_infinity(tmp_path, key, value):
    path = tmp_path / "c.yaml"
    path.write_text(BASE.replace("OUT", str(tmp_path / "out")))
    with pytest.raises(ConfigError, match=f"config key '{key}' got .*expected a finite number"):
        load_config(path, [f"--{key}", value])


def test_a_finite_float_and_a_word_sized_int_are_still_taken(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(BASE.replace("OUT", str(tmp_path / "out")))
    cfg = load_config(path, ["--trainer.max_grad_norm", "1e300", "--trainer.max_steps",
                             str(2 ** 63 - 1)])
    assert cfg.trainer.max_grad_norm == 1e300 and math.isfinite(cfg.trainer.max_grad_norm)
    assert cfg.trainer.max_steps == 2 ** 63 - 1
