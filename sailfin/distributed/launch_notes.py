"""Notes a worker leaves for ``sailfin launch`` in ``$SAILFIN_LAUNCH_DIR``, one file
``<kind>-rank<r>`` each, read once the job ends: torchrun reports only exit codes, and
75 means both "saved and stopped on a signal" and "the hang watchdog ended the job".
``training``: steps since its last checkpoint can be lost from now on; ``preempted``:
stopped on a signal with a checkpoint saved, or before its first step; ``finished``: a
stop during the teardown loses nothing; ``hang``; ``error``: a user error (exit 2). A
worker clears its notes when it starts; outside ``sailfin launch`` nothing is written.

Example::

    leave_note(PREEMPTED)                  # in a worker
    read_notes(directory)[PREEMPTED]       # in the launcher: {0, 1}
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

LAUNCH_DIR_ENV = "SAILFIN_LAUNCH_DIR"
"""Set by ``sailfin launch`` for its workers: where each worker leaves its notes."""

KINDS = TRAINING, PREEMPTED, FINISHED, HANG, USER_ERROR = (
    "training", "preempted", "finished", "hang", "error")


def _rank() -> str:
    return os.environ.get("RANK", str(os.getpid()))


def _note(kind: str) -> Optional[str]:
    """The path of this worker's ``kind`` note; None outside ``sailfin launch``."""
    where = os.environ.get(LAUNCH_DIR_ENV)
    return os.path.join(where, f"{kind}-rank{_rank()}") if where else None


def leave_note(kind: str) -> None:
    """Record ``kind`` for this worker (a no-op outside ``sailfin launch``)."""
    path = _note(kind)
    if path:
        with contextlib.suppress(OSError), open(path, "w") as fh:
            fh.write(f"{os.getpid()}\n")


def clear_notes() -> None:
    """Remove this worker's notes: it starts afresh (torchrun restarted it)."""
    for path in filter(None, map(_note, KINDS)):
        with contextlib.suppress(OSError):
            os.remove(path)


def noted_by_others(kind: str) -> list[int]:
    """The other local workers that left a ``kind`` note (empty outside sailfin launch)."""
    where = os.environ.get(LAUNCH_DIR_ENV)
    if not where:
        return []
    me = _rank()
    return sorted(r for r in read_notes(where)[kind] if str(r) != me)


def read_notes(where: str) -> dict[str, set[int]]:
    """The launcher's view: for each kind, the ranks that left that note."""
    out: dict[str, set[int]] = {kind: set() for kind in KINDS}
    try:
        names = os.listdir(where)
    except OSError:
        return out
    for name in names:
        kind, _, rank = name.partition("-rank")
        if kind in out and rank.isdigit():
            out[kind].add(int(rank))
    return out
