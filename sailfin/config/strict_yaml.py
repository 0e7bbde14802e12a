"""Reading a config file strictly: UTF-8 text, safe YAML tags only, no key given twice.

PyYAML's ``safe_load`` keeps the last of two equal keys in a mapping without a
word, so a config that sets ``lr`` twice trains with whichever came last. Here
that is an error naming the key and both lines. A byte that is not UTF-8 is an
error naming the file, line and byte offset, not a ``UnicodeDecodeError``.
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from .errors import ConfigError


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key repeated in one mapping.

    Example::

        yaml.load("a: 1\\na: 2\\n", Loader=StrictLoader)   # ConfigError: key 'a' ... twice
    """

    source = "<string>"

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
                raise ConfigError(f"config file {self.source}: key '{key}' is given twice in "
                                  f"one mapping (lines {first} and {line}); YAML would keep "
                                  "only the last: remove one")
        return super().construct_mapping(node, deep=deep)


def load_yaml_file(path: str | os.PathLike) -> Any:
    """The YAML document in ``path``; ConfigError naming the file for every way it can be bad."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory; give a YAML file") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ConfigError(f"config file {path} is not UTF-8 text: byte 0x{data[exc.start]:02x} "
                          f"at offset {exc.start} (line {line}); save the file as UTF-8"
                          ) from None
    loader = StrictLoader(text)
    loader.source = str(path)
    too_deep = ConfigError(f"config file {path} nests values more than {MAX_DEPTH} levels "
                           "deep; a config is a few levels of mappings: flatten it")
    try:
        document = loader.get_single_data()
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    except RecursionError:  # PyYAML composes and constructs recursively
        raise too_deep from None
    finally:
        loader.dispose()
    if _depth(document) > MAX_DEPTH:  # what loads may still be too deep to copy or print
        raise too_deep
    return document


# Deeper than this is no config: the schema's deepest key is a few levels down.
MAX_DEPTH = 100


def _depth(document: Any) -> int:
    """How many mappings and lists deep ``document`` goes (without recursion)."""
    deepest, stack, seen = 0, [(document, 1)], set()
    while stack:
        value, depth = stack.pop()
        if not isinstance(value, (dict, list)) or id(value) in seen:
            continue
        seen.add(id(value))  # YAML aliases can share a node: visit it once
        deepest = max(deepest, depth)
        stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return deepest
