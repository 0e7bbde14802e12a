"""The hang watchdog: a stuck rank is named, and the job ends instead of hanging.

The training loop writes where it is into a :class:`Heartbeat` (an attribute
store per phase: no lock, no clock, no store round-trip on the step's path).
A background thread per rank turns that into a record once a second: the
step, the phase, and the seconds since the record last changed, measured on
this rank's own clock; it writes the record to the process group's store.
Rank 0's thread reads every rank's record. When a rank has made no progress
for ``hang_seconds`` (or its record stopped coming: a frozen process), rank 0
writes a report to the store; every rank's thread sees it within a second,
writes its own stack (``faulthandler``, all threads) to its stderr and to
``<output_dir>/hang/stack-rank<r>.txt``, and rank 0 prints one line per rank
and the rank(s) the others wait for: the ones furthest behind (an earlier
step, or an earlier phase of the same step). Then each process exits with
code 75 (EX_TEMPFAIL), so ``torchrun --max-restarts`` restarts the group and
the run resumes from its last checkpoint.

The thread runs Python, so it needs the GIL: a rank blocked in a collective,
in ``time.sleep``, in I/O or in CUDA waits is seen (those release the GIL); a
C extension that holds the GIL forever silences the thread, and rank 0 then
reports that rank's records as stopped.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

from .exit_codes import HANG_EXIT_CODE

log = logging.getLogger("sailfin")

AUTO_HANG_SECONDS = 300.0

# Phases, in the order a step runs them (the report compares ranks by (step, phase)).
DATA = "data loading"
FORWARD = "forward/train_step"
BACKWARD = "backward"  # a step's last micro-batch: DDP's gradient all-reduce runs in it
ALL_REDUCE = "gradient all-reduce"
OPTIMIZER = "optimizer"
END_OF_STEP = "end of step (logging, checkpoint save, callbacks)"
CHECKPOINT_SAVE = "checkpoint save"
VALIDATION = "validation"
END_OF_EPOCH = "end of epoch (checkpoint save, callbacks)"
SETUP = "starting"
FINISHED = "finished"
FAILED = "stopped by an error"  # training raised on this rank: the others wait for it
_ORDER = {p: i for i, p in enumerate((FAILED, SETUP, DATA, FORWARD, BACKWARD, ALL_REDUCE,
                                       OPTIMIZER, END_OF_STEP, CHECKPOINT_SAVE, VALIDATION,
                                       END_OF_EPOCH, FINISHED))}
_AFTER_STEP = {END_OF_STEP, CHECKPOINT_SAVE, VALIDATION, END_OF_EPOCH, FINISHED}
# Phases known to take long on every rank at once (saves, validation, user callbacks):
# they get trainer.distributed.hang_seconds_slow_phases, not hang_seconds.
SLOW_PHASES = frozenset({END_OF_STEP, CHECKPOINT_SAVE, VALIDATION, END_OF_EPOCH})
HANG_KEY = "trainer.distributed.hang_seconds"
SLOW_KEY = "trainer.distributed.hang_seconds_slow_phases"


class Heartbeat:
    """Where this rank is: written by the loop, read by the watchdog's thread.

    ``step`` is the number of optimizer steps done when the current step began
    (the step in progress is ``step + 1``, as logs and checkpoints count).

    Example::

        beat = Heartbeat()
        beat.step, beat.phase = 4, FORWARD     # the loop, in step 5
        for batch in beat.count(val_loader):   # progress inside a long phase
            ...
    """

    __slots__ = ("step", "phase", "beats")

    def __init__(self) -> None:
        self.step = 0
        self.phase = SETUP
        self.beats = 0

    def count(self, items: Iterable[Any]) -> Iterator[Any]:
        """Yield ``items``, counting each as progress (validation batches)."""
        for item in items:
            self.beats += 1
            yield item


@dataclass(frozen=True)
class RankRecord:
    """One rank's last record: its position and seconds since it last moved."""

    rank: int
    step: int
    phase: str
    idle: float
    seq: int = 0

    @property
    def position(self) -> tuple[int, int]:
        return self.step, _ORDER.get(self.phase, 0)

    def describe(self) -> str:
        where = f"global_step {recipe_step(self.step, self.phase)}"
        return (f"rank {self.rank}: {where}, phase {self.phase}, "
                f"{self.idle:.1f} s since its last progress")


def recipe_step(step: int, phase: str) -> int:
    """The ``global_step`` the recipe sees in ``phase``: ``train_step`` gets the steps done
    before it (``step``); the end-of-step callbacks and validation get the step counted."""
    return step + 1 if phase in _AFTER_STEP else step


def culprits(records: list[RankRecord], stale: Iterable[int] = ()) -> list[int]:
    """The rank(s) the others wait for: records that stopped coming, else the ranks
    furthest behind (earliest step, then earliest phase); every rank when all are at
    the same place."""
    stale = sorted(stale)
    if stale:
        return stale
    live = [r for r in records if r.phase != FINISHED]
    if not live:
        return []
    lowest = min(r.position for r in live)
    return [r.rank for r in live if r.position == lowest]


def hang_report(records: list[RankRecord], hang_seconds: float,
                stale: Optional[dict[int, float]] = None,
                slow_seconds: Optional[float] = None) -> list[str]:
    """The lines rank 0 prints: a header naming the rank(s) waited for and the phase they
    are in, with the limit that was hit and the key that raises it; one line per rank."""
    stale = stale or {}
    names = culprits(records, stale)
    everyone = len(names) == len({r.rank for r in records}) and not stale and len(names) > 1
    phases = {r.phase for r in records if r.rank in names}
    slow = bool(phases) and phases <= SLOW_PHASES and not stale
    limit, key = (slow_seconds or hang_seconds, SLOW_KEY) if slow else (hang_seconds, HANG_KEY)
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
        note = ""
        if r.rank in stale:
            note = (f" (no record for {stale[r.rank]:.0f} s: still in set-up or resume)"
                    if r.seq < 0 else
                    f" (its records stopped {stale[r.rank]:.0f} s ago: process frozen or gone)")
        lines.append("  " + r.describe() + note + mark)
    return lines


class Watchdog:
    """A thread that ends the job with a report when a rank stops making progress.

    ``store`` is the process group's key-value store (shared by all ranks); one
    process may use a private ``torch.distributed.HashStore``. ``on_hang`` ends
    the process (default: flush and ``os._exit(75)``); tests replace it.

    Example::

        beat = Heartbeat()
        dog = Watchdog(beat, store, rank=0, world_size=2, hang_seconds=300)
        dog.start()
        ...                     # the loop writes beat.step / beat.phase
        dog.stop()
    """

    def __init__(self, heartbeat: Heartbeat, store: Any, rank: int, world_size: int,
                 hang_seconds: float, interval: float = 1.0,
                 report_dir: Optional[str] = None,
                 on_hang: Optional[Callable[[int], None]] = None,
                 slow_seconds: Optional[float] = None) -> None:
        self.heartbeat, self.store = heartbeat, store
        self.rank, self.world_size = rank, world_size
        self.hang_seconds, self.interval = float(hang_seconds), interval
        # The limit in SLOW_PHASES (saves, validation, callbacks); hang_seconds when unset.
        self.slow_seconds = max(float(slow_seconds or hang_seconds), self.hang_seconds)
        self.report_dir = report_dir
        self.on_hang = on_hang or _exit
        self.report: Optional[list[str]] = None  # rank 0: the lines it printed
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._seen: dict[int, tuple[int, float]] = {}  # rank 0: rank -> (seq, when it moved)
        self._present: list[str] = []  # rank 0: the record keys that exist
        self._started = time.monotonic()

    def start(self) -> None:
        self._started = time.monotonic()
        self._publish(0.0, 0)
        self._thread = threading.Thread(target=self._run, name="sailfin-watchdog",
                                        daemon=True)
        self._thread.start()

    def stop(self, failed: bool = False) -> None:
        """Stop the thread; this rank's record says it finished (not a hang), or, when
        ``failed``, that training raised here (its partners may wait for it)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        try:
            self.heartbeat.phase = FAILED if failed else FINISHED
            self._publish(0.0, -1)
        except Exception:  # noqa: BLE001 - the store may be gone at the end of a job
            pass

    # -- the thread --------------------------------------------------------------------
    def _run(self) -> None:
        beat = self.heartbeat
        last, moved, seq = None, time.monotonic(), 0
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            position = (beat.step, beat.phase, beat.beats)
            if position != last:
                last, moved = position, now
            seq += 1
            try:
                self._publish(now - moved, seq)
                if self.rank == 0:
                    self._judge(now)
                if self.store.check([_HANG]):
                    self._end()
                    return
            except Exception as exc:  # noqa: BLE001 - a store gone at exit is no hang
                if not self._stop.is_set():
                    log.warning("hang watchdog (rank %d) stopped: %s", self.rank, exc)
                return

    def _publish(self, idle: float, seq: int) -> None:
        beat = self.heartbeat
        self.store.set(f"{_PREFIX}/rank{self.rank}",
                       json.dumps([beat.step, beat.phase, round(idle, 2), seq]))

    def _records(self) -> list[RankRecord]:
        # One multi_get a second once every rank has written (a rank still starting
        # has no key yet, and a get would wait for it).
        if len(self._present) < self.world_size:
            self._present = [k for k in (f"{_PREFIX}/rank{r}" for r in range(self.world_size))
                             if k in self._present or self.store.check([k])]
        present = self._present
        values = self.store.multi_get(present) if present else []
        out = []
        for key, raw in zip(present, values):
            step, phase, idle, seq = json.loads(raw)
            out.append(RankRecord(int(key.rsplit("rank", 1)[1]), step, phase, idle, seq))
        return out

    def _judge(self, now: float) -> None:
        records = self._records()
        stale: dict[int, float] = {}
        if now - self._started > self.hang_seconds:  # ranks that never reached training
            have = {r.rank for r in records}
            for rank in range(self.world_size):
                if rank not in have:
                    records.append(RankRecord(rank, 0, SETUP, now - self._started, -1))
                    stale[rank] = now - self._started
        for r in records:
            seq, when = self._seen.get(r.rank, (None, now))
            if seq != r.seq:
                self._seen[r.rank] = (r.seq, now)
            elif r.phase not in (FINISHED, FAILED) and now - when > self._limit(r.phase):
                stale[r.rank] = now - when
        if stale or any(r.idle > self._limit(r.phase) and r.phase != FINISHED
                        for r in records):
            self.report = hang_report(records, self.hang_seconds, stale, self.slow_seconds)
            self.store.set(_HANG, "\n".join(self.report))

    def _limit(self, phase: str) -> float:
        return self.slow_seconds if phase in SLOW_PHASES else self.hang_seconds

    def _end(self) -> None:
        """Every rank: its stack; rank 0: the report; then the exit."""
        beat = self.heartbeat
        header = (f"hang watchdog: stack of rank {self.rank} (global_step "
                  f"{recipe_step(beat.step, beat.phase)}, "
                  f"phase {beat.phase}, pid {os.getpid()})")
        _write_stack(header, sys.stderr)
        if self.report_dir:
            try:
                os.makedirs(self.report_dir, exist_ok=True)
                with open(os.path.join(self.report_dir, f"stack-rank{self.rank}.txt"),
                          "w") as fh:
                    _write_stack(header, fh)
            except OSError:
                pass
        self.store.add(_ACKS, 1)
        wait = min(10.0, max(2.0, self.hang_seconds / 2))
        if self.rank == 0:
            _wait_for(lambda: self.store.add(_ACKS, 0) >= self.world_size, wait)
            lines = self.report or self.store.get(_HANG).decode().splitlines()
            where = f" and to {self.report_dir}" if self.report_dir else ""
            lines = lines + [f"every rank wrote its stack to its stderr{where}; exiting with "
                             f"code {HANG_EXIT_CODE} (torchrun --max-restarts restarts the "
                             "job, which resumes from its last checkpoint)"]
            for line in lines:
                log.error("%s", line)
            self.store.set(_DONE, "1")
            time.sleep(0.5)  # the others read it before this process (maybe the store's
            #                  host) goes
        else:
            # Under torchrun, the first worker to exit makes the agent stop the others:
            # let rank 0 print the report first.
            _wait_for(lambda: self.store.check([_DONE]), wait)
        self.on_hang(HANG_EXIT_CODE)


_PREFIX = "sailfin/watchdog"
_HANG = f"{_PREFIX}/hang"
_ACKS = f"{_PREFIX}/acks"
_DONE = f"{_PREFIX}/reported"


def _write_stack(header: str, fh: Any) -> None:
    fh.write(f"sailfin: {header}\n")
    fh.flush()
    faulthandler.dump_traceback(file=fh, all_threads=True)
    fh.flush()


def _wait_for(condition: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except Exception:  # noqa: BLE001 - the store's host may be gone
            return
        time.sleep(0.05)


def _exit(code: int) -> None:
    for handler in log.handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the main thread is stuck: only a hard exit ends the process


def resolve_hang_seconds(value: Any, world_size: int) -> Optional[float]:
    """``trainer.distributed.hang_seconds``: auto is 300 s with several processes, off
    with one; null is off."""
    if value is None:
        return None
    if value == "auto":
        return AUTO_HANG_SECONDS if world_size > 1 else None
    return float(value)


def resolve_slow_seconds(value: Any, hang_seconds: float) -> float:
    """``trainer.distributed.hang_seconds_slow_phases``: auto is 4 x hang_seconds; null
    is hang_seconds itself; never below hang_seconds."""
    if value is None:
        return hang_seconds
    if value == "auto":
        return 4 * hang_seconds
    return max(float(value), hang_seconds)


def build_watchdog(hang_setting: Any, rank: int, world_size: int, store: Any,
                   heartbeat: Heartbeat, report_dir: Optional[str],
                   slow_setting: Any = "auto") -> Optional[Watchdog]:
    """A started :class:`Watchdog` as ``trainer.distributed.hang_seconds`` asks, or None.

    ``store`` is the process group's (None on one process: a private store serves)."""
    seconds = resolve_hang_seconds(hang_setting, world_size)
    if seconds is None:
        return None
    if store is None:
        import torch.distributed as dist
        store = dist.HashStore()
    dog = Watchdog(heartbeat, store, rank, world_size, seconds,
                   interval=min(1.0, seconds / 4), report_dir=report_dir,
                   slow_seconds=resolve_slow_seconds(slow_setting, seconds))
    dog.start()
    return dog
