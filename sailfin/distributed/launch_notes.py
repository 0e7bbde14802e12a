"""Notes a worker leaves for ``sailfin launch``: what happened to it, read once the job ends.

torchrun reports only exit codes, and 75 means both "saved and stopped on a
signal" and "the hang watchdog ended the job". Each worker therefore leaves a
small file in the directory the launcher names in ``SAILFIN_LAUNCH_DIR``:

- ``training-rank<r>``: it began training (steps since its last checkpoint can be
  lost from now on);
- ``preempted-rank<r>``: it stopped on a signal with a checkpoint saved, or before
  its first step (nothing to lose);
- ``finished-rank<r>``: its training finished (a stop during the teardown loses nothing);
- ``hang-rank<r>``: the hang watchdog ended it;
- ``error-rank<r>``: it printed a user error (a config, a checkpoint, a full disk) and
  exited 2; the other workers' ends (torchrun stops them) follow from it.

A worker clears its notes when it starts (a restarted worker's notes are its own
attempt's). Outside ``sailfin launch`` nothing is written.

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

TRAINING, PREEMPTED, FINISHED, HANG, USER_ERROR = ("training", "preempted", "finished",
                                                   "hang", "error")
KINDS = (TRAINING, PREEMPTED, FINISHED, HANG, USER_ERROR)


def _directory() -> Optional[str]:
    return os.environ.get(LAUNCH_DIR_ENV) or None


def _rank() -> str:
    return os.environ.get("RANK", str(os.getpid()))


def leave_note(kind: str) -> None:
    """Record ``kind`` for this worker (a no-op outside ``sailfin launch``)."""
    where = _directory()
    if not where:
        return
    with contextlib.suppress(OSError):
        with open(os.path.join(where, f"{kind}-rank{_rank()}"), "w") as fh:
            fh.write(f"{os.getpid()}\n")


def clear_notes() -> None:
    """Remove this worker's notes: it starts afresh (torchrun restarted it)."""
    where = _directory()
    if not where:
        return
    for kind in KINDS:
        with contextlib.suppress(OSError):
            os.remove(os.path.join(where, f"{kind}-rank{_rank()}"))


def noted_by_others(kind: str) -> list[int]:
    """The other local workers that left a ``kind`` note (empty outside sailfin launch)."""
    where = _directory()
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
