"""PyMarlin's ``def __init__(self, args, data)``: an unannotated ``args`` gets its settings
as an attribute-style namespace, given as ``init_args: {args: {...}}`` or flat."""

from __future__ import annotations

import pytest

from sailfin import ModuleInterface
from sailfin.config import ConfigError, from_dict
from sailfin.config.pymarlin_args import PyMarlinArgs


class PyMarlinStyle(ModuleInterface):
    def __init__(self, args, data=None):
        super().__init__()
        self.args = args


class Annotated(ModuleInterface):
    def __init__(self, args: dict, lr: float = 0.1):
        super().__init__()
        self.args, self.lr = args, lr


def build(cls: type, init_args: dict):
    return from_dict({"module": {"class_path": f"{__name__}.{cls.__name__}",
                                 "init_args": init_args}}).build()


def test_an_args_section_is_read_as_attributes():
    module = build(PyMarlinStyle, {"args": {"max_lr": 4e-5, "log_level": "INFO",
                                            "sched": {"warmup": 0.1}}})
    args = module.args
    assert args.max_lr == 4e-5 and args.log_level == "INFO" and args.sched.warmup == 0.1
    assert args["max_lr"] == 4e-5 and args.get("missing", 3) == 3 and "log_level" in args
    assert dict(**args)["max_lr"] == 4e-5
    assert args.to_dict() == {"max_lr": 4e-5, "log_level": "INFO", "sched": {"warmup": 0.1}}


def test_flat_settings_go_to_args_as_pymarlin_gave_them():
    module = build(PyMarlinStyle, {"max_lr": 4e-5, "log_level": "DEBUG"})
    assert isinstance(module.args, PyMarlinArgs)
    assert (module.args.max_lr, module.args.log_level) == (4e-5, "DEBUG")


def test_an_annotated_args_keeps_its_type_and_unknown_keys_stay_errors():
    assert build(Annotated, {"args": {"a": 1}}).args == {"a": 1}
    with pytest.raises(ConfigError, match="lrr"):
        build(Annotated, {"args": {}, "lrr": 0.2})


def test_a_missing_attribute_says_its_name():
    args = PyMarlinArgs({"a": 1})
    with pytest.raises(AttributeError, match="b"):
        args.b
    with pytest.raises(KeyError):
        args["b"]
