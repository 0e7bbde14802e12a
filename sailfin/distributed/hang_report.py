"""What the hang watchdog says: the phases a rank reports, and the report that names the
rank(s) the others wait for (:func:`culprits` says which).

Example::

    records = [RankRecord(0, 4, BACKWARD, 12.0), RankRecord(1, 4, FORWARD, 12.5)]
    culprits(records)            # [1]
    hang_report(records, 10)     # the lines rank 0 prints
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

# Phases, in the order a run goes through them (the report compares ranks by (step, phase)).
SETUP = "starting"  # joining the group, building, resuming: before the start-up checks
STARTUP_CHECKS = "start-up checks (sanity validation batches)"
# Done with its own sanity batches, waiting for the other ranks' outputs.
STARTUP_CHECKS_GATHER = "start-up checks (gathering every rank's outputs)"
DATA = "data loading"
FORWARD = "forward/train_step"
BACKWARD = "backward"  # a step's last micro-batch: DDP's gradient all-reduce runs in it
ALL_REDUCE = "gradient all-reduce"
OPTIMIZER = "optimizer"
END_OF_STEP = "end of step (logging, checkpoint save, callbacks)"
CHECKPOINT_SAVE = "checkpoint save"
VALIDATION = "validation"
# Done with its own validation batches, waiting for the other ranks' outputs: a rank still
# in VALIDATION is behind it.
VALIDATION_GATHER = "validation (gathering every rank's outputs)"
END_OF_EPOCH = "end of epoch (checkpoint save, callbacks)"
FINISHED = "finished"
FAILED = "stopped by an error"  # training raised on this rank: the others wait for it
_ORDER = {p: i for i, p in enumerate((FAILED, SETUP, STARTUP_CHECKS, STARTUP_CHECKS_GATHER,
                                       DATA, FORWARD, BACKWARD, ALL_REDUCE, OPTIMIZER,
                                       END_OF_STEP, CHECKPOINT_SAVE, VALIDATION,
                                       VALIDATION_GATHER, END_OF_EPOCH, FINISHED))}
_AFTER_STEP = {END_OF_STEP, CHECKPOINT_SAVE, VALIDATION, VALIDATION_GATHER, END_OF_EPOCH,
               FINISHED}
# Phases known to take long on every rank at once (building and loading a model, saves,
# validation, user callbacks) get hang_seconds_slow_phases, not hang_seconds.
SLOW_PHASES = frozenset({SETUP, STARTUP_CHECKS, STARTUP_CHECKS_GATHER, END_OF_STEP,
                         CHECKPOINT_SAVE, VALIDATION, VALIDATION_GATHER, END_OF_EPOCH})
HANG_KEY = "trainer.distributed.hang_seconds"
SLOW_KEY = "trainer.distributed.hang_seconds_slow_phases"


@dataclass(frozen=True)
class RankRecord:
    """One rank's last record: its position, seconds since it last moved, and its process
    (``host``, ``pid``: a frozen process on a live rank's host is ended by that rank)."""

    rank: int
    step: int
    phase: str
    idle: float
    seq: int = 0
    pid: int = 0
    host: str = ""

    @property
    def position(self) -> tuple[int, int]:
        return self.step, _ORDER.get(self.phase, 0)

    def describe(self) -> str:
        return (f"rank {self.rank}: global_step {recipe_step(self.step, self.phase)}, "
                f"phase {self.phase}, {self.idle:.1f} s since its last progress")


def recipe_step(step: int, phase: str) -> int:
    """The ``global_step`` the recipe sees in ``phase``: ``train_step`` gets the steps done
    before it (``step``); the end-of-step callbacks and validation get the step counted."""
    return step + 1 if phase in _AFTER_STEP else step


def limit_of(phase: str, hang_seconds: float, slow_seconds: Optional[float] = None) -> float:
    """The seconds without progress that count as a hang in ``phase``."""
    slow = phase in SLOW_PHASES
    return max(slow_seconds or hang_seconds, hang_seconds) if slow else hang_seconds


def culprits(records: list[RankRecord], stale: Iterable[int] = (),
             busy: Iterable[int] = ()) -> list[int]:
    """The rank(s) the others wait for: records that stopped coming, else the ranks
    furthest behind (earliest step, then earliest phase); among ranks at the same place,
    the ones still ``busy`` (they moved clearly later than the others);
    every rank when all wait at the same place."""
    stale = sorted(stale)
    if stale:
        return stale
    live = [r for r in records if r.phase != FINISHED]
    lowest = min((r.position for r in live), default=None)  # None: every rank finished
    behind = [r.rank for r in live if r.position == lowest]
    working = [rank for rank in behind if rank in set(busy)]
    return working if working and len(working) < len(behind) else behind


def hang_report(records: list[RankRecord], hang_seconds: float,
                stale: Optional[dict[int, float]] = None,
                slow_seconds: Optional[float] = None) -> list[str]:
    """The lines the watchdog prints: a header naming the rank(s) waited for and the phase
    they are in, with the limit that was hit and the key that raises it; one line per rank."""
    stale = stale or {}
    # Still making progress: moved clearly later than the rank that waited longest (more
    # than the records' one-second cadence and a tenth of the limit): the others wait for it.
    live = [r for r in records if r.phase not in (FINISHED, FAILED)]
    longest = max((r.idle for r in live), default=0.0)
    busy = [r.rank for r in live if r.idle <= longest - max(
        2.0, 0.1 * limit_of(r.phase, hang_seconds, slow_seconds))]
    names = culprits(records, stale, busy)
    everyone = len(names) == len({r.rank for r in records}) and not stale and len(names) > 1
    phases = {r.phase for r in records if r.rank in names}
    slow = bool(phases) and phases <= SLOW_PHASES and not stale
    limit, key = (limit_of(VALIDATION, hang_seconds, slow_seconds), SLOW_KEY) if slow \
        else (hang_seconds, HANG_KEY)
    idle = max((r.idle for r in records if r.rank in names), default=0.0)
    if everyone and slow:
        who = (f"all ranks in {' / '.join(sorted(phases))} for {idle:.0f} s: if this work "
               f"is this slow on purpose (a large save, a long validation or callback), "
               f"raise {key}")
    elif everyone:
        who = (f"all ranks in {' / '.join(sorted(phases))} for {idle:.0f} s; every rank is "
               "at the same place: a collective that does not complete (network, NCCL), or "
               "work every rank shares, is stuck")
    else:
        who = (f"waiting for rank {', '.join(map(str, names))} "
               f"(in {' / '.join(sorted(phases))})")
    lines = [f"hang watchdog: no progress for more than {limit:g} s ({key}); {who}"]
    for r in sorted(records, key=lambda r: r.rank):
        mark = "   <- stuck" if r.rank in names and not everyone else ""
        line = r.describe()
        if r.rank in stale:
            line = (f"rank {r.rank}: no record for {stale[r.rank]:.0f} s: still in set-up or "
                    "resume" if r.seq < 0 else
                    f"rank {r.rank}: its records stopped {stale[r.rank]:.0f} s ago: process "
                    f"frozen or gone (its last: global_step "
                    f"{recipe_step(r.step, r.phase)}, phase {r.phase})")
        lines.append("  " + line + mark)
    return lines
