"""Reading a config file strictly: UTF-8 text, safe YAML tags only, no key given twice
(PyYAML's ``safe_load`` silently keeps the last of two equal keys), bounded size,
nesting and alias expansion; every error names the file, and the line where known.
"""

from __future__ import annotations

import os
import stat
from typing import Any, Optional

import yaml

from .errors import ConfigError


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
    too_deep = ConfigError(f"{source} nests values more than {MAX_DEPTH} levels "
                           "deep; a config is a few levels of mappings: flatten it")
    try:
        document = loader.get_single_data()
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source} is not valid YAML: {_one_line(exc)}") from None
    except RecursionError:  # PyYAML composes and constructs recursively
        raise too_deep from None
    finally:
        loader.dispose()
    if loader.aliases > MAX_ALIASES:
        raise ConfigError(f"{source} uses YAML aliases (*name) {loader.aliases} "
                          f"times, more than {MAX_ALIASES}; a config needs a few: write the "
                          "values out")
    depth, size = _measure(document)
    if depth > MAX_DEPTH:  # what loads may still be too deep to copy or print
        raise too_deep
    if size > MAX_EXPANDED:
        raise ConfigError(f"{source} expands through its YAML aliases (*name) to "
                          f"more than {MAX_EXPANDED:,} values and characters; a config is "
                          "small: write the values out once, or load big data from a file")
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
    with os.fdopen(fd, "rb") as fh:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ConfigError(f"{label} is {_file_kind(mode)}, not a regular file; give a "
                              "YAML file")
        data = fh.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{label} is larger than {MAX_FILE_BYTES // 2**20} MiB; "
                          "a config is a few KB: load big data from a file the recipe reads")
    return data


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


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


# Bounds on a document: deeper than this is no config (the schema's deepest key is a few
# levels down); more aliases or a bigger expansion is a YAML "billion laughs", which would
# hang whatever walks or prints the value.
MAX_DEPTH = 100
MAX_ALIASES = 1000
MAX_EXPANDED = 10_000_000


def _measure(document: Any) -> tuple[int, int]:
    """How deep ``document`` nests and its size with every alias written out (values plus
    characters of strings), computed once per shared node (no recursion, no expansion)."""
    deepest, size_of = 0, {}
    stack: list[tuple[Any, int, bool]] = [(document, 1, False)]
    depth_seen: dict[int, int] = {}
    while stack:
        value, depth, done = stack.pop()
        if not isinstance(value, (dict, list)):
            continue
        children = list(value.keys()) + list(value.values()) if isinstance(value, dict) \
            else value
        if done:
            size_of[id(value)] = min(MAX_EXPANDED + 1, 1 + sum(_size(c, size_of) for c in children))
            continue
        if depth_seen.get(id(value), 0) >= depth:
            continue  # a shared node seen at this depth or deeper: its depth is counted
        first = id(value) not in depth_seen
        depth_seen[id(value)] = depth
        deepest = max(deepest, depth)
        if deepest > MAX_DEPTH:
            return deepest, 0
        if first:
            stack.append((value, depth, True))
        stack.extend((c, depth + 1, False) for c in children)
    return deepest, _size(document, size_of)


def _size(value: Any, size_of: dict[int, int]) -> int:
    if isinstance(value, (dict, list)):
        return size_of.get(id(value), 1)
    return 1 + len(value) if isinstance(value, str) else 1
