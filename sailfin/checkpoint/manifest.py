"""The manifest: a small JSON file that says what a checkpoint is and holds.

It is the last file written; a checkpoint directory without one is
incomplete (a save that did not finish) and is never loaded.

Example manifest::

    {"format": "sailfin-checkpoint/1", "step": 120, "epoch": 2, "step_in_epoch": 20,
     "samples_seen": 3840, "world_size": 2, "seed": 42, "sailfin_version": "0.1.0",
     "files": {"model.pt": {"size": 4211, "crc32": "8a3f01c2"}, ...}, "config": {...}}
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

from .errors import CheckpointCorrupt
from .serialize import FileEntry

FORMAT = "sailfin-checkpoint/1"
MANIFEST = "manifest.json"
REQUIRED = ("step", "epoch", "step_in_epoch", "samples_seen", "world_size", "files")
COUNTERS = ("step", "epoch", "step_in_epoch", "samples_seen", "world_size")


def encode(facts: Mapping[str, Any], files: Mapping[str, FileEntry]) -> bytes:
    body = {"format": FORMAT, **facts,
            "files": {name: entry.to_json() for name, entry in sorted(files.items())}}
    return (json.dumps(_finite(body), indent=2, default=str) + "\n").encode("utf-8")


def decode(data: bytes, shown: str) -> dict[str, Any]:
    """Parse and check a manifest; ``shown`` names it in errors."""
    try:
        body = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointCorrupt(f"checkpoint manifest {shown} is not valid JSON ({exc}): it "
                                "is damaged", shown) from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        found = body.get("format") if isinstance(body, dict) else type(body).__name__
        raise CheckpointCorrupt(f"checkpoint manifest {shown} has format {found!r}; this "
                                f"sailfin reads {FORMAT!r}", shown)
    missing = [k for k in REQUIRED if k not in body]
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
    try:
        return {name: FileEntry(int(e["size"]), int(e["crc32"], 16))
                for name, e in manifest["files"].items()}
    except (AttributeError, KeyError, TypeError, ValueError):
        raise CheckpointCorrupt(f"checkpoint manifest {shown} has a malformed 'files' "
                                "table", shown) from None


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
