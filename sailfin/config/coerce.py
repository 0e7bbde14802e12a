"""Typed conversion of YAML values and command-line strings into dataclass fields: bool,
int, float, str, Optional[T], list[T], Literal[...], nested dataclasses and plain dicts
(anything else in the schema is a programming error, reported as such).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types
import typing
from typing import Any, Literal, Union

from .errors import ConfigError, short_repr, suggest, unknown_key
from .strict_yaml import load_yaml_text


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return f"list of {type_name(item)}"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def parse_cli_value(text: str, tp: Any) -> Any:
    """Parse a command-line string for a field of type ``tp``.

    Strings stay as typed (``sp-amp``, ``007``) unless the field accepts
    something else too; everything else is read as YAML (``null``, ``1e-3``,
    ``[stdout, jsonl]``, ``-5``).
    """
    if tp is str:
        return text
    return load_yaml_text(text, f"override value {short_repr(text)}") if text != "" else ""


def coerce(value: Any, tp: Any, key: str, finite: bool = False) -> Any:
    """Check ``value`` against ``tp`` and convert where it is lossless.

    ``finite`` (sailfin's own options): a float must be a number, not NaN or
    infinity (an option that can be turned off says so with null), and an int
    must fit a machine word (what loaders, ``range`` and ``islice`` take)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, key, finite)
            except OutOfRange:
                raise  # the right type, a value it cannot take: say why, not "expected ..."
            except ConfigError:
                continue
        raise _wrong(key, value, tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value in allowed:
            return value
        raise ConfigError(
            f"config key '{key}' got {short_repr(value)}{suggest(value, map(str, allowed))}; "
            f"expected one of: {', '.join(map(str, allowed))}"
        )
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        if isinstance(value, tuple):
            value = list(value)
        if isinstance(value, str) and item is str:
            value = [value]  # `--trainer.writers stdout` means a list of one
        if not isinstance(value, list):
            raise _wrong(key, value, tp)
        return [coerce(v, item, f"{key}[{i}]", finite) for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise _wrong(key, value, tp)
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise _wrong(key, value, tp)
        return build_dataclass(tp, value, prefix=key + ".")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _wrong(key, value, tp)
    if tp is int:
        number = int(value) if isinstance(value, float) and value.is_integer() else value
        if isinstance(number, int) and not isinstance(number, bool):  # 1e3 written in YAML
            return _in_word(number, key) if finite else number
        raise _wrong(key, value, tp)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise _wrong(key, value, tp)
        try:
            number = float(value)  # a string too: YAML 1.1 reads "1e-3" as one
        except OverflowError:  # an int past the float range (10**400)
            number = math.inf if value > 0 else -math.inf
        except ValueError:
            raise _wrong(key, value, tp) from None
        if finite and not math.isfinite(number):
            raise OutOfRange(f"config key '{key}' got {short_repr(value)}; "
                              "expected a finite number "
                              "(NaN and infinity mean nothing for this option; an option that "
                              "can be off takes null)")
        return number
    if tp is str:
        if isinstance(value, str):
            if finite and "\0" in value:  # a path with it ends in "embedded null byte"
                raise OutOfRange(f"config key '{key}' got {short_repr(value)}, "
                                  "which holds a NUL byte "
                                  "(\\0): no path or name can hold one; remove it")
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise _wrong(key, value, tp)
    raise TypeError(f"sailfin config schema uses an unsupported type {tp!r} for '{key}'")


class OutOfRange(ConfigError):
    """A value of the right type that the option cannot take (NaN, 10**30)."""


def _in_word(value: int, key: str) -> int:
    if abs(value) > sys.maxsize:
        raise OutOfRange(f"config key '{key}' got {value}, which is out of range: at most "
                          f"{sys.maxsize} (2**63 - 1)")
    return value


def _wrong(key: str, value: Any, tp: Any) -> ConfigError:
    return ConfigError(
        f"config key '{key}' got {short_repr(value)} ({type(value).__name__}); "
        f"expected {type_name(tp)}"
    )


def field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def build_dataclass(cls: type, values: dict, prefix: str = "") -> Any:
    """Build ``cls`` from a dict, rejecting unknown keys with a suggestion."""
    types_ = field_types(cls)
    aliases: dict[str, str] = getattr(cls, "_aliases", {})
    kwargs: dict[str, Any] = {}
    for raw_key, value in values.items():
        key = aliases.get(raw_key, raw_key)
        if key not in types_:
            raise unknown_key(str(raw_key), list(types_) + list(aliases), prefix)
        if key in kwargs:
            raise ConfigError(
                f"config key '{prefix}{key}' is given twice (once as '{raw_key}'); keep one"
            )
        kwargs[key] = coerce(value, types_[key], prefix + key, finite=True)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {exc}") from None
