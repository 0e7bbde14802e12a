"""Reading a config file strictly: UTF-8 text, safe YAML tags only, no key given twice
(PyYAML's ``safe_load`` silently keeps the last of two equal keys), bounded size,
nesting and alias expansion; every error names the file, and the line where known.
"""

from __future__ import annotations

import os
import stat
from typing import Any, Optional

import yaml

from ..utils.files import file_kind
from .errors import ConfigError
from .limits import CONFIG_MAX_BYTES, CONFIG_MAX_DEPTH, TooBig, json_size


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key repeated in one mapping.

    Example::

        yaml.load("a: 1\\na: 2\\n", Loader=StrictLoader)   # ConfigError: key 'a' ... twice
    """

    source = "config text"
    aliases = 0  # how many *alias uses the document holds (bounded: a billion laughs)

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # '<<: *base' keys may be overridden on purpose
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: SafeLoader reports it
            if first is None:
                seen[key] = line
            else:
                raise ConfigError(f"{self.source}: key '{key}' is given twice in "
                                  f"one mapping (lines {first} and {line}); YAML would keep "
                                  "only the last: remove one")
        return super().construct_mapping(node, deep=deep)


def load_yaml_file(path: str | os.PathLike, named_in: Optional[str] = None) -> Any:
    """The YAML document in ``path``; ConfigError naming the file (and the file whose
    ``extends:`` named it, ``named_in``) for every way it can be bad."""
    return load_yaml_text(_read_config_bytes(path, named_in), f"config file {path}")


def load_yaml_text(data: bytes | str, source: str) -> Any:
    """The YAML document in ``data`` with the checks of :func:`load_yaml_file`: UTF-8, safe
    tags, no key given twice, bounded nesting and alias expansion. Every error is one line
    that begins with ``source`` (``"config file a.yaml"``, ``"override --trainer.x"``)."""
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = data[:exc.start].count(b"\n") + 1
            raise ConfigError(f"{source} is not UTF-8 text: byte "
                              f"0x{data[exc.start]:02x} at offset {exc.start} (line {line}); "
                              "save the file as UTF-8") from None
    else:
        text = data
    loader = StrictLoader(text)
    loader.source = source
    try:
        document = loader.get_single_data()
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source} is not valid YAML: {_one_line(exc)}") from None
    except RecursionError:  # PyYAML composes and constructs recursively
        raise ConfigError(f"{source} nests values more than {CONFIG_MAX_DEPTH} levels "
                          "deep; a config is a few levels of mappings: flatten it") from None
    finally:
        loader.dispose()
    if loader.aliases > MAX_ALIASES:
        raise ConfigError(f"{source} uses YAML aliases (*name) {loader.aliases} "
                          f"times, more than {MAX_ALIASES}; a config needs a few: write the "
                          "values out")
    check_limits(document, source)
    return document


# What a config file may be: text of this many bytes at most (a config is a few KB; a
# device such as /dev/zero or a pipe never ends and is refused before reading).
MAX_FILE_BYTES = 16 * 1024 * 1024


def _read_config_bytes(path: str | os.PathLike, named_in: Optional[str]) -> bytes:
    label = f"config file {path}" + (f" (in 'extends:' of {named_in})" if named_in else "")
    # O_NONBLOCK: opening a FIFO for reading returns at once instead of waiting for a writer,
    # so its kind can be named; a regular file reads as usual.
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise ConfigError(f"{label} not found; paths are relative to the file that names them"
                          if named_in else f"config file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"{label} cannot be opened: {exc.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # before fdopen, which refuses a directory with a traceback
        os.close(fd)
        raise ConfigError(f"{label} is {file_kind(mode)}, not a regular file; give a "
                          "YAML file")
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{label} is larger than {MAX_FILE_BYTES // 2**20} MiB; "
                          "a config is a few KB: load big data from a file the recipe reads")
    return data




def _one_line(exc: yaml.YAMLError) -> str:
    """PyYAML's error without its multi-line source excerpt: what and where."""
    if isinstance(exc, yaml.MarkedYAMLError):
        what = "; ".join(p for p in (exc.context, exc.problem) if p)
        if isinstance(exc, yaml.constructor.ConstructorError) and "tag" in (exc.problem or ""):
            what += (" (a config holds plain mappings, lists, strings and numbers: remove "
                     "the tag)")
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        return f"{what}{where}"
    return " ".join(str(exc).split())


# More aliases than this is a YAML "billion laughs" in the making (a config needs a few);
# how deep and how big a document may be are the config's limits (limits.py), which the
# checkpoint manifest that stores a config shares.
MAX_ALIASES = 1000
MAX_DEPTH = CONFIG_MAX_DEPTH


def check_limits(document: Any, source: str) -> None:
    """Refuse ``document`` (one line beginning with ``source``) when it nests deeper than
    :data:`CONFIG_MAX_DEPTH` or takes more than :data:`CONFIG_MAX_BYTES` written out (its
    aliases expanded, one level down, as a checkpoint's manifest stores it)."""
    if _depth(document) > CONFIG_MAX_DEPTH:  # what loads may still be too deep to copy
        raise ConfigError(f"{source} nests values more than {CONFIG_MAX_DEPTH} levels "
                          "deep; a config is a few levels of mappings: flatten it")
    try:
        json_size(document, depth=1)
    except TooBig:
        raise ConfigError(
            f"{source} takes more than {CONFIG_MAX_BYTES // 2**20} MiB written out (its YAML "
            "aliases (*name) expanded), as every checkpoint's manifest stores it; a config is "
            "small: write the values out once, or load big data from a file the recipe "
            "reads") from None


def _depth(document: Any) -> int:
    """How deep ``document`` nests (no recursion; a node shared through aliases is walked
    again only where it sits deeper than before)."""
    deepest, seen = 0, {}
    stack: list[tuple[Any, int]] = [(document, 1)]
    while stack:
        value, depth = stack.pop()
        if not isinstance(value, (dict, list)) or seen.get(id(value), 0) >= depth:
            continue
        seen[id(value)] = depth
        deepest = max(deepest, depth)
        if deepest > CONFIG_MAX_DEPTH:
            break
        children = list(value.keys()) + list(value.values()) if isinstance(value, dict) \
            else value
        stack.extend((c, depth + 1) for c in children)
    return deepest
