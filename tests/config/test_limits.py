"""The config loader and the checkpoint manifest share one pair of limits (how deep, how
big): a config that loads can be saved in a manifest and resumed from it, and one whose
aliases would write out to more than the bound is refused when it is loaded."""

import json

import pytest

from sailfin.cli import main
from sailfin.config import ConfigError, load_config
from sailfin.config.limits import CONFIG_MAX_BYTES, CONFIG_MAX_DEPTH
from tests.recipes import LinearRecipe


class DeepRecipe(LinearRecipe):
    """LinearRecipe with a free-form mapping among its arguments."""

    def __init__(self, data, extra: dict | None = None, **kw) -> None:
        super().__init__(data, **kw)
        self.extra = extra


def nested(levels: int) -> str:
    """A mapping nested ``levels`` deep (flow style)."""
    return "{a: " * levels + "1" + "}" * levels


def config(tmp_path, init_args: str, epochs: int = 1) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(
        "data: {class_path: tests.recipes.IdData, init_args: {n_train: 20, n_val: 4}}\n"
        f"module: {{class_path: tests.config.test_limits.DeepRecipe, init_args: {init_args}}}\n"
        f"trainer: {{epochs: {epochs}, train_batch_size: 10, writers: [jsonl], "
        f"output_dir: {tmp_path / 'out'}, checkpoint: {{every_n_steps: 1}}}}\n")
    return str(path)


def test_the_deepest_config_that_loads_saves_and_resumes(tmp_path, capsys):
    # The document, module:, init_args:, extra: then the mapping: the deepest that loads.
    deepest = CONFIG_MAX_DEPTH - 3
    assert deepest >= 70
    path = config(tmp_path, f"{{extra: {nested(deepest)}}}")
    assert main(["train", path]) == 0, capsys.readouterr().err
    path = config(tmp_path, f"{{extra: {nested(deepest)}}}", epochs=2)
    assert main(["train", path]) == 0
    err = capsys.readouterr().err
    assert "resuming from" in err and "step-00000002" in err and "damaged" not in err, err
    manifest = json.loads((tmp_path / "out" / "checkpoints" / "step-00000004" /
                           "manifest.json").read_text())
    assert manifest["step"] == 4
    with pytest.raises(ConfigError, match=f"more than {CONFIG_MAX_DEPTH} levels deep"):
        load_config(config(tmp_path, f"{{extra: {nested(deepest + 1)}}}"))


def test_dotted_overrides_count_toward_the_depth(tmp_path):
    path = config(tmp_path, "{}")
    key = "--module.init_args.extra." + ".".join(["a"] * (CONFIG_MAX_DEPTH + 1))
    with pytest.raises(ConfigError, match=f"more than {CONFIG_MAX_DEPTH} levels deep"):
        load_config(path, [key, "1"])


def aliased(width: int, levels: int) -> str:
    """``levels`` anchored lists, each ``width`` aliases of the one before: width**levels
    small values once written out, in a few hundred bytes of YAML."""
    lines = ["  l0: &l0 [" + ", ".join(["12345"] * width) + "]"]
    lines += [f"  l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]"
              for i in range(1, levels)]
    return "\n".join(lines)


def test_a_config_whose_aliases_write_out_past_the_bound_is_refused_at_load(tmp_path, capsys):
    # 20**5 = 3.2 million values: once accepted, a manifest the reader refused.
    path = tmp_path / "big.yaml"
    path.write_text("module:\n  class_path: tests.config.test_limits.DeepRecipe\n"
                    "  init_args:\n    extra:\n" + aliased(20, 5).replace("\n  ", "\n      ")
                    .replace("  l0", "      l0", 1) + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message.startswith(f"config file {path} ") and "\n" not in message
    assert f"more than {CONFIG_MAX_BYTES // 2**20} MiB" in message
    assert main(["train", str(path)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_config_just_under_the_bound_writes_a_manifest_the_reader_takes(tmp_path):
    from sailfin.checkpoint import manifest

    # The manifest reader takes whatever a config within the bound adds up to.
    assert manifest.MAX_BYTES >= 2 * CONFIG_MAX_BYTES
    assert manifest.MAX_DEPTH > CONFIG_MAX_DEPTH


def test_a_config_given_as_a_dict_is_held_to_the_same_limits():
    from sailfin.config import from_dict

    deep: dict = {"a": 1}
    for _ in range(CONFIG_MAX_DEPTH):
        deep = {"a": deep}
    with pytest.raises(ConfigError, match=f"^the config nests values more than "
                                          f"{CONFIG_MAX_DEPTH} levels deep"):
        from_dict({"module": {"class_path": "tests.recipes.LinearRecipe",
                              "init_args": {"extra": deep}}})
    wide = {"module": {"class_path": "tests.recipes.LinearRecipe",
                       "init_args": {"extra": [list(range(1000))] * 1000}}}  # shared rows
    with pytest.raises(ConfigError, match="^the config takes more than 4 MiB written out"):
        from_dict(wide)
