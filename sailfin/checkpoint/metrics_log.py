"""Make ``metrics.jsonl`` read as one run after a resume.

A killed run may leave a half-written last line and events logged after the
checkpoint it resumes from; the resumed run logs those steps again. Before the
writer reopens the file, this drops both, so the file holds each event once.
"""

from __future__ import annotations

import json
from typing import Iterator, Optional

from .storage import LocalStorage


def trim_metrics_log(path: str, step: int, validated: bool) -> int:
    """Keep the events up to checkpoint ``step``; return how many lines were dropped.

    Events with a larger step go, and so do torn or unreadable lines. At ``step``
    itself, training events stay (they are logged before a save); validation events
    stay only if ``validated`` (the checkpoint was taken after that step's
    validation), else the resumed run logs them again. The file is replaced
    atomically; a missing file is fine.
    """
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return 0
    lines = data.split(b"\n")
    # split leaves the text after the last newline: empty, or a torn line.
    complete, tail = lines[:-1], lines[-1]
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
        LocalStorage().write_bytes(path, b"".join(line + b"\n" for line in kept))
    return dropped


def last_logged_step(path: str) -> Optional[int]:
    """The largest ``step`` of a complete event in ``metrics.jsonl`` (None: no events):
    after a crash, how far the run had come at least."""
    try:
        return max((e[0] for e in map(_event, _complete_lines(path)) if e), default=None)
    except FileNotFoundError:
        return None


def _complete_lines(path: str) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        for line in fh:
            if not line.endswith(b"\n"):
                return  # a torn last line
            yield line


def _event(line: bytes) -> Optional[tuple[int, dict]]:
    """(step, event) of a line, or None for a torn line or one that is not an event."""
    try:
        event = json.loads(line)
        return int(event["step"]), event
    except (ValueError, KeyError, TypeError):
        return None
