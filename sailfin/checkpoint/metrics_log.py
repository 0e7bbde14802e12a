"""Make ``metrics.jsonl`` read as one run after a resume.

A killed run may leave a half-written last line and events logged after the
checkpoint it resumes from; the resumed run logs those steps again. Before the
writer reopens the file, this drops both, so the file holds each event once.
"""

from __future__ import annotations

import json
import os


def trim_metrics_log(path: str, step: int, validated: bool) -> int:
    """Keep the events up to checkpoint ``step``; return how many lines were dropped.

    Events with a larger step go, and so do torn or unreadable lines. At
    ``step`` itself, training events stay (they are logged before a save);
    validation events stay only if ``validated`` (the checkpoint was taken after
    that step's validation), else the resumed run logs them again. The file is
    replaced atomically; a missing file is fine.
    """
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return 0
    lines = data.split(b"\n")
    # split leaves the text after the last newline: empty, or a torn line.
    complete, tail = lines[:-1], lines[-1]
    kept: list[bytes] = []
    for line in complete:
        try:
            event = json.loads(line)
            event_step = int(event["step"])
        except (ValueError, KeyError, TypeError):
            continue  # a torn line (a killed writer) or one that is not an event
        if event_step > step or (event_step == step and event.get("split") == "val"
                                 and not validated):
            continue
        kept.append(line)
    dropped = len(complete) - len(kept) + (1 if tail else 0)
    if dropped:
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as fh:
            fh.write(b"".join(line + b"\n" for line in kept))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    return dropped


def last_logged_step(path: str) -> "int | None":
    """The largest ``step`` of a complete event in ``metrics.jsonl`` (None: no events).

    After a crash it says how far the run had come: the steps between the
    checkpoint and this one are lost (at least; training events are logged
    every ``log_every_n_steps``).
    """
    last = None
    try:
        with open(path, "rb") as fh:
            for line in fh:
                if not line.endswith(b"\n"):
                    break  # a torn last line
                try:
                    step = int(json.loads(line)["step"])
                except (ValueError, KeyError, TypeError):
                    continue
                last = step if last is None else max(last, step)
    except FileNotFoundError:
        return None
    return last
