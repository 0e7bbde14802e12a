"""``extends:``: a config built on one or more others.

A top-level ``extends:`` names a YAML file, or a list of them, each relative to
the file that names it (absolute paths work too). The bases are merged first,
in the order listed, then the file itself, then the command-line overrides:

- mappings merge key by key, at every depth;
- anything else (a number, a string, a list, ``null``) in the later file
  replaces the earlier value whole: lists are not concatenated;
- a base may extend others in turn. A file that extends itself, directly or
  through others, and a base that does not exist are errors naming the files.
"""

from __future__ import annotations

import os
import stat
from typing import Any, Callable, Optional

from .errors import ConfigError, short_repr
from .strict_yaml import file_kind, load_yaml_file

KEY = "extends"


def read_mapping(path: str) -> dict:
    """One YAML file as a dict (empty file: ``{}``), with the loader's checks: UTF-8, safe
    tags, no key given twice."""
    raw = load_yaml_file(path) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping; got {type(raw).__name__}")
    return raw


def resolve_extends(raw: dict, path: Optional[str | os.PathLike],
                    read: Callable[[str], dict] = read_mapping) -> dict:
    """``raw`` (read from ``path``) with its ``extends:`` bases merged under it.

    ``read`` reads one base file into a dict (the loader's own reader, so that
    bases are read with the same checks as the file named on the command line).
    """
    if KEY not in raw:
        return raw
    if path is None:
        raise ConfigError("'extends:' needs a config file to resolve its paths against")
    here = os.path.realpath(os.fspath(path))
    return _resolve(raw, here, [here], read)


def _resolve(raw: dict, here: str, chain: list[str], read: Callable[[str], dict]) -> dict:
    bases = _base_paths(raw.get(KEY), here)
    merged: dict = {}
    for base in bases:
        if base in chain:
            loop = " -> ".join(chain[chain.index(base):] + [base])
            raise ConfigError(f"config files extend each other in a cycle: {loop}; "
                              f"remove one 'extends:'")
        if not os.path.exists(base):
            raise ConfigError(f"config file {base} (in 'extends:' of {here}) not found; "
                              f"paths are relative to the file that names them")
        mode = os.stat(base).st_mode
        if not stat.S_ISREG(mode):  # a FIFO would wait for a writer, /dev/zero never ends
            what = "a directory" if stat.S_ISDIR(mode) else file_kind(mode)
            raise ConfigError(f"config file {base} (in 'extends:' of {here}) is {what}, not "
                              "a regular file; name a YAML file")
        content = read(base)
        if KEY in content:
            content = _resolve(content, base, chain + [base], read)
        merged = merge(merged, content)
    own = {k: v for k, v in raw.items() if k != KEY}
    return merge(merged, own)


def _base_paths(value: Any, here: str) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(
            isinstance(v, str) and v.strip() for v in items):
        raise ConfigError(f"'extends:' in {here} must be a file path or a list of them, "
                          f"got {short_repr(value)}")
    folder = os.path.dirname(here)
    return [os.path.realpath(os.path.join(folder, os.path.expanduser(v))) for v in items]


def merge(base: dict, over: dict) -> dict:
    """``over`` on top of ``base``: mappings merge at every depth; other values replace."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out
