"""The manifest: a small JSON file that says what a checkpoint is and holds, written last
(a checkpoint directory without one is never loaded).

Example manifest::

    {"format": "sailfin-checkpoint/3", "step": 120, "epoch": 2, "step_in_epoch": 20,
     "samples_seen": 3840, "world_size": 2, "seed": 42, "sailfin_version": "0.2.0",
     "sharded": {"format": "torch-dcp/1", "dir": "shards", "keys": ["module", ...],
                 "files": {"__0_0.distcp": {"size": 70211, "crc32": "8a3f01c2"}, ...},
                 "entries": {"trainer": {"size": 4211, "crc32": "1b0e77d3",
                                         "file": "__0_0.distcp"}, ...}},
     "config": {...}, "manifest_crc32": "0c5e11aa"}

Formats /1 and /2 (earlier releases) list files beside the shards under ``files``
(``trainer.pt``, ``rng-rank0000N.pt``, and ``model.pt`` before the shards).
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

from ..config.limits import MANIFEST_MAX_BYTES, MANIFEST_MAX_DEPTH
from ..utils.crc import crc32
from .errors import CheckpointCorrupt
from .serialize import FileEntry, plain_name

FORMAT = "sailfin-checkpoint/3"  # /3: the small state is in the shards, no ``files``
OLDER = ("sailfin-checkpoint/2", "sailfin-checkpoint/1")  # /2: the manifest's own CRC-32
MANIFEST = "manifest.json"
# Bounds on what is parsed: a manifest is a few kB (the config included); a damaged or
# hostile one must not take the start-up's memory or Python's stack. They follow the
# config's own bounds: whatever config loads, its checkpoints' manifests read back.
MAX_BYTES = MANIFEST_MAX_BYTES
MAX_DEPTH = MANIFEST_MAX_DEPTH
REQUIRED = ("step", "epoch", "step_in_epoch", "samples_seen", "world_size")
COUNTERS = ("step", "epoch", "step_in_epoch", "samples_seen", "world_size")


#: The manifest's own CRC-32, of its other keys in canonical JSON: a flipped bit is damage
#: (``resume: auto`` falls back), not a change of config. Older manifests (format /1) lack it.
SELF_CHECK = "manifest_crc32"


def encode(facts: Mapping[str, Any], files: Mapping[str, FileEntry]) -> bytes:
    """``files``: files beside the shards (none from sailfin's own saves)."""
    body = {"format": FORMAT, **facts}
    if files:
        body["files"] = {name: entry.to_json() for name, entry in sorted(files.items())}
    return seal(json.loads(json.dumps(_finite(body), default=str)))


def seal(body: dict[str, Any]) -> bytes:
    """``body`` (plain JSON values) as a manifest file, its own checksum added."""
    body = {k: v for k, v in body.items() if k != SELF_CHECK}
    body[SELF_CHECK] = f"{_crc(body):08x}"
    return (json.dumps(body, indent=2) + "\n").encode("utf-8")


def _crc(body: Mapping[str, Any]) -> int:
    return crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8"))


def decode(data: bytes, shown: str) -> dict[str, Any]:
    """Parse and check a manifest; ``shown`` names it in errors."""
    if len(data) > MAX_BYTES:
        raise CheckpointCorrupt(f"checkpoint manifest {shown} has {len(data)} bytes, more than "
                                f"a manifest holds ({MAX_BYTES}): it is damaged", shown)
    try:
        body = json.loads(data.decode("utf-8"))
        too_deep = _depth(body) > MAX_DEPTH
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointCorrupt(f"checkpoint manifest {shown} is not valid JSON ({exc}): it "
                                "is damaged", shown) from None
    except RecursionError:
        too_deep = True
    if too_deep:
        raise CheckpointCorrupt(f"checkpoint manifest {shown} nests deeper than "
                                f"{MAX_DEPTH} levels: it is damaged", shown)
    if not isinstance(body, dict) or body.get("format") not in (FORMAT, *OLDER):
        found = body.get("format") if isinstance(body, dict) else type(body).__name__
        raise CheckpointCorrupt(f"checkpoint manifest {shown} has format {found!r}; this "
                                f"sailfin reads {', '.join(repr(f) for f in (FORMAT, *OLDER))}",
                                shown)
    if body["format"] != OLDER[-1]:
        claimed = body.pop(SELF_CHECK, None)
        if claimed != f"{_crc(body):08x}":
            raise CheckpointCorrupt(f"checkpoint manifest {shown} does not match its own "
                                    f"CRC-32 ({SELF_CHECK}): it was altered or damaged after "
                                    "the save", shown)
    # /3 keeps everything in the shards; the formats before list files beside them.
    missing = [k for k in REQUIRED + (("sharded",) if body["format"] == FORMAT else ("files",))
               if k not in body]
    if missing:
        raise CheckpointCorrupt(f"checkpoint manifest {shown} lacks {', '.join(missing)}: it is "
                                "damaged", shown)
    for key in COUNTERS:
        value = body[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointCorrupt(f"checkpoint manifest {shown} has {key} {value!r}, not a "
                                    "count (an integer >= 0): it is damaged", shown)
    return body


def files_of(manifest: Mapping[str, Any], shown: str) -> dict[str, FileEntry]:
    """The manifest's ``files`` table, checked: at least one file, each a plain ``.pt``
    name in the checkpoint's directory with a size and a CRC-32."""
    table = manifest["files"]
    if not isinstance(table, dict) or not table:
        raise CheckpointCorrupt(f"checkpoint manifest {shown} lists no files ('files' is "
                                f"{table!r}): it is damaged", shown)
    out = {}
    for name, entry in table.items():
        if not (plain_name(name) and name.endswith(".pt")):
            raise CheckpointCorrupt(f"checkpoint manifest {shown} lists {name!r}, not a file "
                                    "name in the checkpoint's directory: it is damaged or "
                                    "was tampered with; sailfin reads nothing outside it", shown)
        try:
            size, crc = entry["size"], entry["crc32"]
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ValueError(size)
            if not (isinstance(crc, str) and len(crc) <= 8):
                raise ValueError(crc)
            out[name] = FileEntry(size, int(crc, 16))
        except (KeyError, TypeError, ValueError):
            raise CheckpointCorrupt(f"checkpoint manifest {shown} has a malformed entry for "
                                    f"{name} (want {{\"size\": bytes, \"crc32\": hex}}): it is "
                                    "damaged", shown) from None
    return out


def _depth(value: Any) -> int:
    """How deep ``value`` nests (iterative: no recursion on a hostile document)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth > MAX_DEPTH:
                return depth
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict)
                                                   else item))
    return deepest


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
