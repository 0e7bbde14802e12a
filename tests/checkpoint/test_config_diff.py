"""Resume compares the config with the checkpoint's: a change that defines the training
stops the run before its first step; a change that may happen on a resume is printed."""

import json

import pytest

from sailfin import Trainer
from sailfin.trainer.checkpointing.config_diff import (MAY_CHANGE, ConfigChanged, compare, may_change,
                                            recorded_config)
from sailfin.cli import main
from sailfin.config import load_config
from sailfin.checkpoint.manifest import seal
from tests.checkpoint.helpers import params
from tests.recipes import IdData, LinearRecipe, args

CONFIG = """
data: {class_path: tests.recipes.IdData, init_args: {n_train: 40, n_val: 10}}
module: {class_path: tests.recipes.LinearRecipe, init_args: {lr: 0.05}}
trainer: {epochs: 1, train_batch_size: 10, micro_batch_size: 10, writers: [jsonl],
          output_dir: OUT, seed: 3, progress: none}
"""


def config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG.replace("OUT", str(tmp_path / "out")))
    return str(path)


def test_the_safe_list_is_one_table_and_unknown_keys_are_conservative():
    assert may_change("trainer.backend") and may_change("trainer.checkpoint.every_n_steps")
    assert may_change("trainer.distributed.timeout_seconds") and may_change("trainer.ema.decay")
    for key in ("trainer.seed", "trainer.train_batch_size", "trainer.shuffle",
                "trainer.max_grad_norm", "trainer.drop_last", "module.init_args.lr",
                "data.class_path", "trainer.some_new_key"):
        assert not may_change(key), key
    assert {"epochs", "max_steps", "backend", "amp_dtype", "micro_batch_size", "writers",
            "log_every_n_steps", "checkpoint", "hang_seconds", "val_every_n_steps", "ema",
            "fsdp"} <= set(MAY_CHANGE)


def test_compare_lists_each_key_with_both_values():
    before = {"trainer": {"seed": 1, "backend": "sp"},
              "module": {"class_path": "a.B", "init_args": {"lr": 0.1, "depth": 2}}}
    after = {"trainer": {"seed": 1, "backend": "sp-amp"},
             "module": {"class_path": "a.B", "init_args": {"lr": 0.2}}}
    changes = {c.key: c for c in compare(before, after)}
    assert str(changes["trainer.backend"]) == 'trainer.backend: "sp" -> "sp-amp"'
    assert changes["trainer.backend"].allowed
    assert str(changes["module.init_args.lr"]) == "module.init_args.lr: 0.1 -> 0.2"
    assert not changes["module.init_args.lr"].allowed
    assert str(changes["module.init_args.depth"]) == "module.init_args.depth: 2 -> (not set)"
    # A trainer key the checkpoint lacks (added since) is compared with its default.
    assert compare({"trainer": {}}, {"trainer": {"sanity_val_batches": 1}}) == []
    assert [c.key for c in compare({"trainer": {}}, {"trainer": {"seed": 7}})] == \
        ["trainer.seed"]


def test_a_changed_module_argument_stops_before_any_step(tmp_path, capsys):
    """The README's pair: the same config, then --module.init_args.lr=0.1."""
    cfg = config(tmp_path)
    assert main(["train", cfg]) == 0
    lines = (tmp_path / "out" / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["train", cfg, "--module.init_args.lr=0.1", "--trainer.seed", "4"]) == 2
    err = capsys.readouterr().err
    assert "differs from that of checkpoint" in err
    assert "    module.init_args.lr: 0.05 -> 0.1\n    trainer.seed: 3 -> 4\n" in err
    assert "--trainer.output_dir NEW_DIR" in err and "--trainer.init_from" in err
    assert "--trainer.resume_config accept" in err
    assert (tmp_path / "out" / "metrics.jsonl").read_text() == lines  # nothing ran


def test_accept_continues_with_the_new_values_and_says_so(tmp_path, capsys):
    cfg = config(tmp_path)
    assert main(["train", cfg]) == 0
    capsys.readouterr()
    assert main(["train", cfg, "--module.init_args.lr=0.1", "--trainer.epochs", "2",
                 "--trainer.resume_config", "accept"]) == 0
    err = capsys.readouterr().err
    assert ("resume: config changed since the checkpoint: module.init_args.lr: 0.05 -> 0.1 "
            "(accepted (trainer.resume_config: accept))") in err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["global_step"] == 8


def test_changes_that_may_happen_on_resume_are_printed_one_line_each(tmp_path, capsys):
    """The README's pair: char_lm, then --trainer.backend sp-amp: bf16 runs, and says so."""
    cfg = config(tmp_path)
    assert main(["train", cfg]) == 0
    capsys.readouterr()
    assert main(["train", cfg, "--trainer.backend", "sp-amp", "--trainer.epochs", "2",
                 "--trainer.micro_batch_size", "5", "--trainer.log_every_n_steps", "2"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "config changed" in line]
    assert err == [
        'sailfin: resume: config changed since the checkpoint: trainer.backend: "sp" -> '
        '"sp-amp" (how a step executes)',
        "sailfin: resume: config changed since the checkpoint: trainer.epochs: 1 -> 2 "
        "(the run's length)",
        "sailfin: resume: config changed since the checkpoint: trainer.log_every_n_steps: "
        "10 -> 2 (reporting cadence)",
        "sailfin: resume: config changed since the checkpoint: trainer.micro_batch_size: "
        "10 -> 5 (the global batch stays the same)"]


def test_the_python_api_records_and_compares_the_recipe_too(tmp_path):
    """README: sailfin.Trainer(cfg.build(), cfg.trainer).train()."""
    cfg = load_config(config(tmp_path))
    Trainer(cfg.build(), cfg.trainer).train()
    manifest = json.loads(next((tmp_path / "out" / "checkpoints").glob("step-*/manifest.json"))
                          .read_text())
    assert recorded_config(manifest)["module"]["init_args"] == {"lr": 0.05}
    cfg = load_config(config(tmp_path), ["--module.init_args.lr", "0.2"])
    with pytest.raises(ConfigChanged, match="module.init_args.lr: 0.05 -> 0.2"):
        Trainer(cfg.build(), cfg.trainer).train()


def test_checkpoints_without_a_recorded_config_still_resume(tmp_path, capfd):
    """A checkpoint written before configs were recorded: resumed, not compared."""
    first = LinearRecipe(IdData(40, 10))
    Trainer(first, args(tmp_path, epochs=1)).train()
    for manifest in (tmp_path / "checkpoints").glob("step-*/manifest.json"):
        body = json.loads(manifest.read_text())
        del body["config"], body["recipe"]
        manifest.write_bytes(seal(body))
    again = LinearRecipe(IdData(40, 10))
    trainer = Trainer(again, args(tmp_path, epochs=2, seed=5))  # a change nobody can see
    trainer.train()
    assert trainer.resumed_from is not None and trainer.global_step == 8
    assert "records no config (an older sailfin wrote it); not compared" in capfd.readouterr().err
    assert set(params(again)) == set(params(first))


def test_every_trainer_key_is_classified():
    """A new trainer key must be put in MAY_CHANGE or here on purpose: a key left out of
    both would stop every resume that changes it, and nobody would have decided that."""
    import dataclasses

    from sailfin.config.trainer import TrainerArguments

    defines = {"max_train_steps_per_epoch", "train_batch_size", "drop_last", "shuffle", "seed",
               "max_grad_norm",
               "dp"}  # the privacy accounting holds only for the settings it was made with
    names = {f.name for f in dataclasses.fields(TrainerArguments)}
    assert names - set(MAY_CHANGE) == defines
