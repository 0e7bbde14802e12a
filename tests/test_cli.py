import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sailfin.cli import main

ROOT = Path(__file__).resolve().parents[1]

CONFIG = """
data: {class_path: tests.recipes.IdData, init_args: {n_train: 40, n_val: 10}}
module: {class_path: tests.recipes.LinearRecipe, init_args: {lr: 0.05}}
trainer: {epochs: 2, train_batch_size: 10, micro_batch_size: 5, writers: [jsonl],
          output_dir: OUT}
"""


def config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG.replace("OUT", str(tmp_path / "out")))
    return path


def test_train_command(tmp_path, capsys):
    assert main(["train", str(config(tmp_path)), "--trainer.epochs", "3"]) == 0
    out = capsys.readouterr().out
    assert "done: 12 steps, 120 samples" in out and "validation mse:" in out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["global_step"] == 12


def test_training_a_finished_run_again_exits_3_saying_nothing_was_trained(tmp_path, capsys):
    assert main(["train", str(config(tmp_path))]) == 0
    capsys.readouterr()
    assert main(["train", str(config(tmp_path))]) == 3
    captured = capsys.readouterr()
    out_dir = tmp_path / "out"
    assert (f"sailfin: nothing trained: the run in {out_dir} finished at step 8 (at the end of "
            "epoch 2; trainer.epochs 2)") in captured.err
    assert "done:" not in captured.out and "summary:" not in captured.out
    # The first way on the message gives works.
    assert main(["train", str(config(tmp_path)), "--trainer.output_dir", f"{out_dir}-2"]) == 0


@pytest.mark.parametrize("how", [
    ["--trainer.checkpoint.every_n_steps", "2"],  # its last save came before validation
    ["--trainer.max_steps", "6"],                 # it stopped inside an epoch
    []], ids=["saved-before-validation", "max-steps", "epochs"])
def test_training_a_finished_run_again_changes_no_byte_of_its_directory(tmp_path, how):
    """The same command again (exit 3, nothing trained) dropped a metrics.jsonl line 'past
    that step', validated again and appended it anew, and left new TensorBoard files."""
    import hashlib

    pytest.importorskip("tensorboard")
    command = ["train", str(config(tmp_path)), *how,
               "--trainer.writers", "[jsonl, csv, tensorboard, stdout]"]
    out_dir = tmp_path / "out"

    def files():
        return {str(p.relative_to(out_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(out_dir.rglob("*")) if p.is_file()}

    assert main(command) == 0
    before = files()
    assert "metrics.jsonl" in before and any(name.startswith("tensorboard/") for name in before)
    assert main(command) == 3
    assert files() == before


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_launch_help_says_what_launch_adds_to_torchrun(flag, capsys):
    """It printed torchrun's usage ("usage: sailfin [-h] [--nnodes NNODES]") and nothing of
    the closing line or exit code 75."""
    assert main(["launch", flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: sailfin launch [torchrun options] -m sailfin train CONFIG")
    assert "closing line" in out and "Elastic Training Launcher" not in out
    codes = {line.split()[0] for line in out.splitlines() if re.match(r"\s+\d+\s", line)}
    assert {"0", "75", "2", "3", "1"} <= codes
    assert "75   preempted" in out and "requeue" in out
    assert "torchrun --help" in out


def test_a_help_flag_after_the_module_is_the_workers(capsys):
    from sailfin.launch import wants_help

    assert wants_help(["--nproc-per-node=2", "--help"])
    assert not wants_help(["--nproc-per-node=2", "-m", "sailfin", "train", "--help"])
    assert not wants_help(["train.py", "-h"])


def test_print_config(tmp_path, capsys):
    assert main(["train", str(config(tmp_path)), "--print-config",
                 "--trainer.backend=sp", "--trainer.gpu_batch_size_limit", "2"]) == 0
    out = capsys.readouterr().out
    # PyMarlin's ceiling on the command line replaces the file's exact micro batch.
    assert "gpu_batch_size_limit: 2" in out and "micro_batch_size: null" in out
    assert "class_path: tests.recipes.LinearRecipe" in out
    assert not (tmp_path / "out").exists()


def test_config_error_exits_2_with_suggestion(tmp_path, capsys):
    assert main(["train", str(config(tmp_path)), "--trainer.epoch", "3"]) == 2
    err = capsys.readouterr().err
    assert "config error" in err and "did you mean 'epochs'" in err


def _readme_block(lang, first_line):
    text = (ROOT / "README.md").read_text()
    for block in re.findall(rf"```{lang}\n(.*?)```", text, re.S):
        if block.startswith(first_line):
            return block
    raise AssertionError(f"README has no {lang} block starting with {first_line!r}")


def test_the_readme_recipe_trains_through_the_cli(tmp_path):
    """A recipe for another data set, written from the README alone."""
    (tmp_path / "my_recipe.py").write_text(_readme_block("python", "# my_recipe.py"))
    (tmp_path / "wine.yaml").write_text(_readme_block("yaml", "# wine.yaml"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "sailfin", "train", "wine.yaml",
                           "--trainer.writers", "[jsonl]"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "outputs" / "wine" / "summary.json").read_text())
    assert summary["val"]["accuracy"] >= 0.9


def test_the_digits_demo_reaches_95_percent(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "sailfin", "train",
                           "examples/digits/config.yaml", "--trainer.output_dir",
                           str(tmp_path / "digits")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    accuracy = float(re.search(r"validation accuracy: ([0-9.]+)", proc.stdout).group(1))
    assert accuracy >= 0.95
    summary = json.loads((tmp_path / "digits" / "summary.json").read_text())
    assert summary["val"]["accuracy"] == pytest.approx(accuracy, abs=1e-4)


@pytest.mark.parametrize("argv, code, where, text", [
    (["train"], 2, "err", "the following arguments are required: config"),
    (["trian", "x.yaml"], 2, "err", "invalid choice: 'trian'"),
    (["export", "a", "b", "c"], 2, "err", "unrecognized arguments: c"),
    (["launch", "--nproc-per-node"], 2, "err", "expected one argument"),  # torchrun's parser
    (["--version"], 0, "out", "sailfin "),
    (["--help"], 0, "out", "usage: sailfin"),
    (["export", "--help"], 0, "out", "usage: sailfin export"),
])
def test_main_returns_the_code_argparse_would_end_the_process_with(argv, code, where, text,
                                                                  capsys):
    """main() is for in-process use: it raised SystemExit (from argparse) instead."""
    assert main(argv) == code
    assert text in getattr(capsys.readouterr(), where)


def test_the_command_still_exits_with_argparses_code(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "sailfin", "trian", "x.yaml"], env=env,
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2 and "invalid choice: 'trian'" in done.stderr


def test_import_sailfin_is_light():
    code = "import sys, sailfin; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


def test_train_help_lists_every_config_key_from_the_schema(capsys):
    """(#28) Generated from the dataclasses: every key, with its type, default and doc."""
    import dataclasses

    import pytest

    from sailfin import __version__
    from sailfin.config.trainer import TrainerArguments
    from sailfin.cli import main as cli_main

    assert cli_main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  --trainer.")}

    def keys(cls, prefix):
        for f in dataclasses.fields(cls):
            default = getattr(cls(), f.name) if f.name else None
            if dataclasses.is_dataclass(default):
                yield from keys(type(default), f"{prefix}{f.name}.")
            else:
                yield f"--{prefix}{f.name}"

    expected = list(keys(TrainerArguments, "trainer."))
    assert set(expected) == set(lines)
    for key in expected:  # "--trainer.seed  int = 42  Seeds the data order..."
        name, rest = lines[key].split(None, 1)
        assert " = " in rest and len(rest.split(" = ", 1)[1].split("  ", 1)) == 2, lines[key]
    assert "--trainer.seed  int = 42  Seeds the data order" in out
    assert cli_main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"sailfin {__version__}"


def test_train_help_lists_every_backend_the_registry_builds(capsys):
    """The help's backend names are the registry's one list; every name built from the
    same parts but left off it is refused when built."""
    import pytest

    from sailfin.backends import ALIASES, build_backend
    from sailfin.cli import main as cli_main
    from sailfin.config import ConfigError
    from sailfin.config.trainer import BACKENDS, TrainerArguments
    from sailfin.distributed import DistEnv

    assert cli_main(["train", "--help"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines()
                if x.startswith("  --trainer.backend "))
    listed = line.split("one of: ", 1)[1].split(", ")
    assert listed == ["auto", *BACKENDS]  # auto: ddp under a launcher of several, else sp
    assert {"sp", "sp-amp", "ddp", "ddp-amp", "fsdp", "fsdp-amp", "sp-dp", "ddp-dp"} <= \
        set(listed)

    def args(name):
        dp = {"noise_multiplier": 1.0} if name.endswith("-dp") else {}
        return TrainerArguments(backend=name, dp=dp, device="cpu")

    for name in [*ALIASES, *(f"{n}-dp" for n in ALIASES)]:
        if name in listed:
            continue
        with pytest.raises(ConfigError):
            build_backend(args(name), DistEnv())
    build_backend(args("sp-dp"), DistEnv())  # a listed private name builds
    with pytest.raises(ConfigError, match="valid backends: " + ", ".join(listed)):
        build_backend(args("tpu"), DistEnv())


def test_train_help_cuts_each_doc_at_its_first_sentence_not_at_an_abbreviation(capsys):
    import pytest

    from sailfin.cli import main as cli_main
    from sailfin.config.help import first_sentence

    assert cli_main(["train", "--help"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("  --trainer.")]
    ema = next(x for x in lines if x.startswith("  --trainer.ema.decay "))
    assert ema.endswith("In (0, 1); e.g. 0.999 (an average over about 1 / (1 - decay) updates)")
    assert not [x for x in lines if x.endswith((" e.g", " i.e"))]
    assert first_sentence("Stop early. Then more.") == "Stop early"
    assert first_sentence("Cut at 0.5 i.e. half. auto: more") == "Cut at 0.5 i.e. half"


def test_a_run_does_not_build_the_help(tmp_path, monkeypatch, capsys):
    """The keys' docs are read from the schema's source only for --help."""
    import sailfin.config.help as help_module

    def refuse(*args, **kwargs):
        raise AssertionError("the help was built for a run")

    monkeypatch.setattr(help_module, "trainer_keys_help", refuse)
    assert main(["train", str(config(tmp_path)), "--print-config"]) == 0
    with pytest.raises(AssertionError, match="the help was built"):
        main(["train", "--help"])
