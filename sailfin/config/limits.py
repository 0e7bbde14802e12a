"""How deep and how big a config may be: one pair of bounds that the config loader enforces
and the checkpoint manifest (which stores the config) is read with, so that whatever
loads can be saved in a checkpoint and resumed from it.

Example::

    from sailfin.config.limits import CONFIG_MAX_DEPTH, json_size
    json_size({"a": [1, 2]}, depth=1)   # bytes json.dumps(..., indent=2) gives it, 1 level in
"""

from __future__ import annotations

import json
import math
from typing import Any

#: Levels of mappings and lists a config may nest (the document itself is level 1). The
#: schema's deepest key is a few levels down; a recipe's ``init_args`` may hold more.
CONFIG_MAX_DEPTH = 100
#: Bytes a config may take written out as JSON (indent 2, every YAML alias expanded), as a
#: checkpoint's manifest stores it: a few hundred thousand values at most. A config is a
#: few KB; big data belongs in a file the recipe reads.
CONFIG_MAX_BYTES = 4 << 20

#: What the manifest reader takes: the config one level down (under ``recipe``) plus its
#: own few levels, and the config's bytes plus the counters and file table (small).
MANIFEST_MAX_DEPTH = CONFIG_MAX_DEPTH + 8
MANIFEST_MAX_BYTES = 4 * CONFIG_MAX_BYTES


class TooBig(Exception):
    """Raised by :func:`json_size` past ``limit``: the walk stops there."""


def json_size(value: Any, depth: int = 0, limit: int = CONFIG_MAX_BYTES) -> int:
    """The length of ``json.dumps(value, indent=2, default=str)`` where ``value`` sits
    ``depth`` levels into the document (its lines are indented that much more), computed
    once per shared node and depth: aliases are never expanded. Raises :class:`TooBig`
    once the nodes measured exceed ``limit`` bytes, so the work is bounded by ``limit``.
    Recursive: call it only on a value whose depth is already bounded."""
    spent = [0]
    memo: dict[tuple[int, int], int] = {}

    def size(node: Any, level: int) -> int:
        if not isinstance(node, (dict, list)):
            return _scalar(node)
        key = (id(node), level)
        if key in memo:
            return memo[key]
        inner = 2 * (level + 1)  # the indentation of each item's line
        total = 2 + 2 * level  # the brackets, the closing one on a line of its own
        if isinstance(node, dict):
            items = [(_scalar(str(k) if not isinstance(k, str) else k) + 2, v)
                     for k, v in node.items()]  # '"key": '
        else:
            items = [(0, v) for v in node]
        # Each item of a node measured here is at least a byte of the written-out value,
        # in a place no other (node, level) measured holds: the work stays below limit.
        spent[0] += len(items) + 1
        if spent[0] > limit:
            raise TooBig
        for head, child in items:
            total += inner + head + size(child, level + 1) + 2  # ",\n" (or "\n" before })
            if total > limit:
                raise TooBig
        memo[key] = total
        return total

    return size(value, depth)


def _scalar(value: Any) -> int:
    """``len(json.dumps(value, default=str))``, quicker for the common types."""
    kind = type(value)
    if kind is str:
        return len(_QUOTED(value))
    if kind is bool or value is None:
        return 4 if value is not False else 5
    if kind is float and not math.isfinite(value):
        return 3 if value != value else 8 + (value < 0)  # NaN, Infinity, -Infinity
    if kind is int or kind is float:
        try:
            return len(repr(value))
        except ValueError:  # an int too long to print: as long as its digits
            return value.bit_length() * 3 // 10 + 2
    return len(json.dumps(value, default=str))


_QUOTED = json.encoder.encode_basestring_ascii  # what json.dumps writes for a string
