import subprocess
import sys
import textwrap

import pytest

from sailfin import ModuleInterface
from sailfin.config import ConfigError, TrainerArguments, from_dict, load_config
from sailfin.config.loader import parse_overrides


def write(tmp_path, text, name="config.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


BASE = """
module: {class_path: tests.recipes.LinearRecipe, init_args: {lr: 0.1}}
data: {class_path: tests.recipes.IdData, init_args: {n_train: 50}}
trainer: {epochs: 2, train_batch_size: 10}
"""


def test_yaml_loads_into_typed_sections(tmp_path):
    cfg = load_config(write(tmp_path, BASE))
    assert cfg.trainer.epochs == 2 and cfg.trainer.train_batch_size == 10
    assert cfg.module.init_args == {"lr": 0.1}
    assert cfg.trainer.writers == ["stdout", "jsonl"]


def test_unknown_trainer_key_in_yaml_suggests(tmp_path):
    path = write(tmp_path, "trainer: {epoch: 3}\n")
    with pytest.raises(ConfigError, match=r"'trainer.epoch' \(did you mean 'epochs'\?\)"):
        load_config(path)


def test_unknown_section_suggests(tmp_path):
    with pytest.raises(ConfigError, match=r"'trainr' \(did you mean 'trainer'\?\)"):
        load_config(write(tmp_path, "trainr: {epochs: 3}\n"))


def test_unknown_override_key_suggests(tmp_path):
    with pytest.raises(ConfigError, match=r"did you mean 'max_grad_norm'"):
        load_config(write(tmp_path, BASE), ["--trainer.max_grad_nrm", "1.0"])


def test_override_forms_and_types(tmp_path):
    cfg = load_config(write(tmp_path, BASE), [
        "--trainer.backend", "sp", "--trainer.epochs=5", "--trainer.max_steps", "null",
        "--trainer.max_grad_norm", "1e-3", "--trainer.drop_last", "true",
        "--trainer.seed", "7", "--trainer.writers", "[stdout, jsonl]",
        "--trainer.output_dir", "007", "--module.init_args.lr", "-0.5",
    ])
    t = cfg.trainer
    assert (t.epochs, t.max_steps, t.max_grad_norm, t.drop_last, t.seed) == (5, None, 1e-3,
                                                                            True, 7)
    assert t.writers == ["stdout", "jsonl"] and t.output_dir == "007"
    assert cfg.module.init_args["lr"] == -0.5  # a negative number is a value, not a flag


def test_single_writer_override_is_a_list(tmp_path):
    cfg = load_config(write(tmp_path, BASE), ["--trainer.writers", "jsonl"])
    assert cfg.trainer.writers == ["jsonl"]


@pytest.mark.parametrize("key,value,expected", [
    ("epochs", "three", "expected int"),
    ("drop_last", "3", "expected bool"),
    ("max_grad_norm", "abc", "expected float or null"),
    ("writers", "{a: 1}", "expected list of str"),
])
def test_wrong_type_names_key_value_and_type(tmp_path, key, value, expected):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, BASE), [f"--trainer.{key}", value])
    assert f"trainer.{key}" in str(err.value) and expected in str(err.value)


def test_bool_is_not_an_int(tmp_path):
    with pytest.raises(ConfigError, match="trainer.epochs.*True.*expected int"):
        load_config(write(tmp_path, "trainer: {epochs: true}\n"))


@pytest.mark.parametrize("field,value", [("epochs", 0), ("train_batch_size", -1),
                                         ("max_steps", 0), ("max_grad_norm", -1.0)])
def test_out_of_range_values_name_the_key(field, value):
    with pytest.raises(ConfigError, match=f"trainer.{field}"):
        TrainerArguments(**{field: value})


def test_unknown_writer_suggests():
    with pytest.raises(ConfigError, match=r"writers\[1\].*did you mean 'jsonl'"):
        TrainerArguments(writers=["stdout", "jsonll"])


def test_gpu_batch_size_limit_is_pymarlins_ceiling(tmp_path):
    """Not an alias of micro_batch_size: a ceiling, kept as given (the plan resolves it)."""
    cfg = load_config(write(tmp_path, "trainer: {gpu_batch_size_limit: 8}\n"))
    assert cfg.trainer.gpu_batch_size_limit == 8 and cfg.trainer.micro_batch_size is None
    # On the command line, one spelling replaces the file's other one.
    cfg = load_config(write(tmp_path, "trainer: {micro_batch_size: 8}\n"),
                      ["--trainer.gpu_batch_size_limit", "4"])
    assert (cfg.trainer.gpu_batch_size_limit, cfg.trainer.micro_batch_size) == (4, None)
    cfg = load_config(write(tmp_path, "trainer: {gpu_batch_size_limit: 8}\n"),
                      ["--trainer.micro_batch_size=2"])
    assert (cfg.trainer.gpu_batch_size_limit, cfg.trainer.micro_batch_size) == (None, 2)
    assert TrainerArguments(gpu_batch_size_limit=16).gpu_batch_size_limit == 16


def test_micro_batch_and_limit_together_is_one_clear_error(tmp_path):
    message = r"micro_batch_size \(8, exact\) and trainer.gpu_batch_size_limit \(8, " \
              r"PyMarlin's ceiling\) are both set; keep one"
    with pytest.raises(ConfigError, match=message):
        from_dict({"trainer": {"gpu_batch_size_limit": 8, "micro_batch_size": 8}})
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["--trainer.gpu_batch_size_limit", "8", "--trainer.micro_batch_size",
                           "8"])
    with pytest.raises(ConfigError, match=message):
        TrainerArguments(micro_batch_size=8, gpu_batch_size_limit=8)


def test_override_of_a_whole_section_is_an_error():
    with pytest.raises(ConfigError, match="'trainer.epochs' is a value, not a section"):
        load_config(None, ["--trainer.epochs.x", "1"])


def test_override_without_value():
    with pytest.raises(ConfigError, match="needs a value"):
        parse_overrides(["--trainer.epochs"])
    with pytest.raises(ConfigError, match="expected an override"):
        parse_overrides(["epochs", "3"])


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="not found: .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "trainer: {epochs: [1\n"))
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n"))


def test_init_args_checked_against_the_constructor(tmp_path):
    cfg = load_config(write(tmp_path, BASE), ["--module.init_args.lrr", "0.1"])
    with pytest.raises(ConfigError, match=r"module.init_args.lrr' \(did you mean 'lr'\?\)"):
        cfg.build()
    cfg = load_config(write(tmp_path, BASE), ["--module.init_args.lr", "fast"])
    with pytest.raises(ConfigError, match="module.init_args.lr.*expected float"):
        cfg.build()


def test_build_passes_data_and_typed_init_args(tmp_path):
    cfg = load_config(write(tmp_path, BASE), ["--module.init_args.lr", "1"])
    module = cfg.build()
    assert module.lr == 1.0 and isinstance(module.lr, float)
    assert len(module.data.get_train_dataset()) == 50


@pytest.mark.parametrize("path,match", [
    ("NoDots", "must be 'package.module.ClassName'"),
    ("tests.no_such_module.X", "cannot import module 'tests.no_such_module'"),
    ("tests.recipes.LinearRecipee", r"has no 'LinearRecipee' \(did you mean 'LinearRecipe'\?\)"),
])
def test_class_path_errors(path, match):
    cfg = from_dict({"module": {"class_path": path}})
    with pytest.raises(ConfigError, match=match):
        cfg.build()


@pytest.mark.parametrize("section, path, name", [
    ("module", "sailfin.ModuleInterface", "ModuleInterface"),
    ("data", "sailfin.interfaces.DataInterface", "DataInterface"),
])
def test_naming_the_interface_itself_is_refused_before_it_is_called(section, path, name,
                                                                    monkeypatch):
    import sailfin.interfaces

    def called(*args, **kwargs):
        raise AssertionError(f"{name} was called")

    monkeypatch.setattr(getattr(sailfin.interfaces, name), "__init__", called)
    spec = {"module": {"class_path": "tests.recipes.LinearRecipe"},
            "data": {"class_path": "tests.recipes.IdData"}}
    spec[section] = {"class_path": path}
    with pytest.raises(ConfigError, match=rf"^{section}.class_path names sailfin.{name} itself"
                                          r", which holds no .*name your subclass of it"):
        from_dict(spec).build()


def test_config_package_does_not_import_torch():
    code = "import sys, sailfin, sailfin.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


class Unseeded(ModuleInterface):
    """A module whose weights come from torch's global stream."""

    def __init__(self, width: int = 3) -> None:
        import torch
        super().__init__()
        self.weight = torch.randn(width)


def test_build_seeds_before_building_so_python_reproduces_the_cli():
    """README: sailfin.Trainer(cfg.build(), cfg.trainer).train() -- the same initial weights
    on every run, whatever drew from the random streams before."""
    import torch
    cfg = from_dict({"module": {"class_path": "tests.config.test_config.Unseeded"},
                     "trainer": {"seed": 5}})
    torch.manual_seed(123)
    first = cfg.build().weight
    torch.randn(10)
    assert torch.equal(cfg.build().weight, first)
    assert cfg.build().sailfin_config["module"]["class_path"] == \
        "tests.config.test_config.Unseeded"
    torch.manual_seed(5)
    assert torch.equal(torch.randn(3), first)  # seeded with trainer.seed


def test_every_section_given_as_a_dict_from_python_becomes_its_dataclass():
    from sailfin.config.distributed import DistArguments

    args = TrainerArguments(distributed={"launcher": "manual", "rank": 0, "world_size": 1,
                                         "master_addr": "127.0.0.1", "master_port": 29500},
                            checkpoint={"keep_last": 2})
    assert isinstance(args.distributed, DistArguments)
    assert (args.distributed.launcher, args.distributed.world_size) == ("manual", 1)
    assert args.checkpoint.keep_last == 2
    with pytest.raises(ConfigError, match=r"trainer\.distributed\.rnak"):
        TrainerArguments(distributed={"rnak": 0})
    # The section's own checks run too, as they do for a YAML config.
    with pytest.raises(ConfigError, match=r"trainer\.distributed\.master_addr"):
        TrainerArguments(distributed={"launcher": "manual", "rank": 0, "world_size": 1})
