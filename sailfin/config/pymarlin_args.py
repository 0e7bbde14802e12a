"""PyMarlin's recipes take their settings as one unannotated parameter, ``def
__init__(self, args, data)``, and read them as attributes (``args.max_lr``): PyMarlin's
scripts built ``args`` from a config section. sailfin gives such a parameter a
:class:`PyMarlinArgs` of its settings: ``init_args: {args: {max_lr: 4e-5}}``, or the
settings written flat in ``init_args`` beside the class's other parameters
(docs/migrating-from-pymarlin.md).

Example::

    args = PyMarlinArgs({"max_lr": 4e-5, "log_level": "INFO"})
    args.max_lr, args["log_level"], args.get("warmup", 0.0)
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any, Iterator, Mapping

ARGS = "args"


class PyMarlinArgs(SimpleNamespace):
    """Settings read as attributes (``args.max_lr``) or as a mapping (``args["max_lr"]``,
    ``args.get(...)``, ``**args``); a nested section is a PyMarlinArgs too."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        super().__init__(**{str(k): PyMarlinArgs(v) if isinstance(v, Mapping) else v
                            for k, v in values.items()})

    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self.__dict__

    def __iter__(self) -> Iterator[str]:
        return iter(self.__dict__)

    def __len__(self) -> int:
        return len(self.__dict__)

    def keys(self):
        return self.__dict__.keys()

    def items(self):
        return self.__dict__.items()

    def get(self, key: str, default: Any = None) -> Any:
        return self.__dict__.get(key, default)

    def to_dict(self) -> dict[str, Any]:
        return {k: v.to_dict() if isinstance(v, PyMarlinArgs) else v
                for k, v in self.__dict__.items()}


def takes_pymarlin_args(params: Mapping[str, inspect.Parameter], hints: Mapping[str, Any]
                        ) -> bool:
    """The class has PyMarlin's unannotated ``args`` parameter."""
    param = params.get(ARGS)
    return (param is not None and param.annotation is param.empty and ARGS not in hints
            and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY))


def gather_pymarlin_args(init_args: Mapping[str, Any], params: Mapping[str, inspect.Parameter]
                         ) -> dict[str, Any]:
    """``init_args`` with PyMarlin's ``args`` as a :class:`PyMarlinArgs`: the ``args:``
    mapping given, or else every key that is not one of the class's parameters."""
    out = dict(init_args)
    if ARGS in out:
        if isinstance(out[ARGS], Mapping):
            out[ARGS] = PyMarlinArgs(out[ARGS])
        return out
    flat = {k: out.pop(k) for k in list(out) if k not in params}
    if flat or params[ARGS].default is params[ARGS].empty:
        out[ARGS] = PyMarlinArgs(flat)
    return out
