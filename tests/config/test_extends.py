"""``extends:``: base configs merged first, then the file, then the command line."""

import pytest
import yaml

from sailfin.cli import main
from sailfin.config import ConfigError, load_config


def write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def test_merge_order_base_then_file_then_command_line(tmp_path):
    write(tmp_path / "base" / "common.yaml", {
        "module": {"class_path": "tests.recipes.LinearRecipe", "init_args": {"lr": 0.1}},
        "trainer": {"epochs": 5, "seed": 1, "writers": ["stdout", "jsonl", "csv"],
                    "checkpoint": {"keep_last": 7, "best_metric": "mse"}}})
    write(tmp_path / "base" / "long.yaml", {"extends": "common.yaml",  # relative to base/
                                           "trainer": {"epochs": 50, "seed": 2}})
    run = write(tmp_path / "run.yaml", {
        "extends": ["base/long.yaml", "base/common.yaml"],
        "trainer": {"seed": 3, "writers": ["jsonl"], "checkpoint": {"keep_last": 2}}})
    cfg = load_config(run, ["--trainer.checkpoint.keep_last", "4"])
    t = cfg.trainer
    assert t.epochs == 5          # common.yaml, listed after long.yaml, wins over it
    assert t.seed == 3            # the file over its bases
    assert t.writers == ["jsonl"]  # a list replaces the base's list whole
    assert t.checkpoint.best_metric == "mse"  # mappings merge key by key
    assert t.checkpoint.keep_last == 4         # the command line over everything
    assert cfg.module.init_args == {"lr": 0.1}


def test_cycle_names_the_files(tmp_path):
    write(tmp_path / "a.yaml", {"extends": "b.yaml", "trainer": {"epochs": 2}})
    write(tmp_path / "b.yaml", {"extends": "sub/../a.yaml"})
    with pytest.raises(ConfigError, match=r"cycle: .*a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        load_config(tmp_path / "a.yaml")
    write(tmp_path / "self.yaml", {"extends": "self.yaml"})
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "self.yaml")


def test_missing_base_names_both_files(tmp_path):
    run = write(tmp_path / "run.yaml", {"extends": "nope.yaml"})
    with pytest.raises(ConfigError, match=r"nope\.yaml \(in 'extends:' of .*run\.yaml\) not found"):
        load_config(run)


@pytest.mark.parametrize("value", [3, [], ["a.yaml", 4], ""])
def test_extends_must_be_paths(tmp_path, value):
    run = write(tmp_path / "run.yaml", {"extends": value})
    with pytest.raises(ConfigError, match="'extends:' in .*run.yaml must be a file path"):
        load_config(run)


def test_diamond_is_not_a_cycle(tmp_path):
    write(tmp_path / "root.yaml", {"trainer": {"epochs": 9}})
    write(tmp_path / "left.yaml", {"extends": "root.yaml"})
    write(tmp_path / "right.yaml", {"extends": "root.yaml", "trainer": {"seed": 5}})
    run = write(tmp_path / "run.yaml", {"extends": ["left.yaml", "right.yaml"]})
    t = load_config(run).trainer
    assert (t.epochs, t.seed) == (9, 5)


def test_print_config_shows_the_merged_result(tmp_path, capsys):
    write(tmp_path / "base.yaml", {"module": {"class_path": "tests.recipes.LinearRecipe"},
                                   "trainer": {"epochs": 7, "val_every_n_steps": 3}})
    run = write(tmp_path / "run.yaml", "extends: base.yaml\ntrainer: {seed: 11}\n")
    assert main(["train", str(run), "--print-config", "--trainer.ema.decay", "0.99"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["epochs"] == 7 and printed["trainer"]["seed"] == 11
    assert printed["trainer"]["val_every_n_steps"] == 3
    assert printed["trainer"]["ema"]["decay"] == 0.99
    assert "extends" not in printed
