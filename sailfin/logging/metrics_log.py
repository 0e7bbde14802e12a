"""Make ``metrics.jsonl`` read as one run after a resume: a killed run may leave a
half-written last line and events logged after the checkpoint it resumes from.
"""

from __future__ import annotations

import json
from typing import Optional

from ..utils.files import replace_file


def trim_metrics_log(path: str, step: int, validated: bool) -> int:
    """Keep the events up to checkpoint ``step`` (at ``step``, validation events only if
    ``validated``: taken after the checkpoint's validation), drop torn or unreadable
    lines; return how many lines were dropped."""
    complete, tail = _lines(path)
    kept = []
    for line in complete:
        event = _event(line)
        if event is None or event[0] > step:
            continue
        if event[0] == step and event[1].get("split") == "val" and not validated:
            continue  # the resumed run validates that step again
        kept.append(line)
    dropped = len(complete) - len(kept) + (1 if tail else 0)
    if dropped:
        replace_file(path, b"".join(line + b"\n" for line in kept))
    return dropped


def last_logged_step(path: str) -> Optional[int]:
    """The largest ``step`` of a complete event in ``metrics.jsonl`` (None: no events):
    after a crash, how far the run had come at least."""
    return max((e[0] for e in map(_event, _lines(path)[0]) if e), default=None)


def _lines(path: str) -> tuple[list[bytes], bytes]:
    """The complete lines of ``path`` and what follows the last newline (empty, or a torn
    line); none for a missing file."""
    try:
        with open(path, "rb") as fh:
            lines = fh.read().split(b"\n")
    except FileNotFoundError:
        return [], b""
    return lines[:-1], lines[-1]


def _event(line: bytes) -> Optional[tuple[int, dict]]:
    """(step, event) of a line, or None for a torn line or one that is not an event."""
    try:
        event = json.loads(line)
        return int(event["step"]), event
    except (ValueError, KeyError, TypeError):
        return None
