"""The hang watchdog: a stuck rank is named, and the job ends instead of hanging (how it
judges, what it prints and does: docs/multinode.md#reading-a-hang-report).

The loop writes where it is into a :class:`Heartbeat` (plain attributes: nothing on the
step's path); a thread per rank publishes it once a second to the process group's store.
The thread needs the GIL: a C extension that holds it forever silences the thread, and
the judges then report that rank's records as stopped.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Optional

from ..utils.voice import log, say
from .exit_codes import HANG_EXIT_CODE
from .hang_report import (ALL_REDUCE, BACKWARD, CHECKPOINT_SAVE, DATA, END_OF_EPOCH,  # noqa: F401
                          END_OF_STEP, FAILED, FINISHED, FORWARD, OPTIMIZER, SETUP,
                          STARTUP_CHECKS, STARTUP_CHECKS_GATHER, VALIDATION, VALIDATION_GATHER,
                          RankRecord, culprits, hang_report, limit_of, recipe_step)
from .launch_notes import HANG, leave_note
from .launcher_watch import launcher_pid, parent_gone, under_a_launcher

AUTO_HANG_SECONDS = 300.0


class Heartbeat:
    """Where this rank is: written by the loop, read by the watchdog's thread. ``step`` is
    the number of optimizer steps done when the current step began.

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


class Watchdog:
    """A thread that ends the job with a report when a rank stops making progress.

    ``store``: the process group's key-value store (one process: a private ``HashStore``).
    ``on_hang`` acts once the report is out: by default :func:`raise_in_main` (a run in a
    notebook or test is never ended by it); the ``sailfin`` command passes
    :func:`end_process`.

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
        self.on_hang = on_hang or raise_in_main
        self.judge = rank < 2  # rank 0 and, should rank 0 itself stop, rank 1
        self.report: Optional[list[str]] = None  # the judge that reported: its lines
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._seen: dict[int, tuple[int, float]] = {}  # judge: rank -> (seq, when it moved)
        self._present: list[str] = []  # judge: the record keys that exist
        self._process = (os.getpid(), socket.gethostname())
        # torchrun's agent holds the store: killed, the loop stops this worker (preemption)
        self._launcher = launcher_pid() if under_a_launcher() else None
        self._store_gone = False  # with the launcher: no record is written any more

    def start(self) -> None:
        self._started = time.monotonic()
        self._seq = 0  # this rank's record count: a judge sees it move while the rank lives
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
        self.heartbeat.phase = FAILED if failed else FINISHED
        if self._store_gone:
            return
        with contextlib.suppress(Exception):  # the store may be gone at the end of a job
            self._publish(0.0, -1)

    def publish_now(self) -> None:
        """Write this rank's record now (the loop, once, as training begins): a rank that
        stops within its first second is reported where it stopped, not in set-up."""
        if self._thread is None:
            return
        self._seq += 1
        with contextlib.suppress(Exception):  # the thread reports a broken store
            self._publish(0.0, self._seq)

    # -- the thread --------------------------------------------------------------------
    def _run(self) -> None:
        beat = self.heartbeat
        last, moved = None, time.monotonic()
        while not self._stop.wait(self.interval):
            if self._launcher is not None and parent_gone(self._launcher):
                self._store_gone = True  # its store with it: not touched (torch warns)
                return
            now = time.monotonic()
            position = (beat.step, beat.phase, beat.beats)
            if position != last:
                last, moved = position, now
            self._seq += 1
            try:
                self._publish(now - moved, self._seq)
                if self.judge:
                    self._judge(now)
                if self.store.check([_HANG]):
                    self._end()
                    return
            except Exception as exc:  # noqa: BLE001 - a store gone at exit is no hang
                if self._launcher is not None and parent_gone(self._launcher, wait=2.0):
                    self._store_gone = True
                    return  # the launcher was killed: the loop's stop says so, once
                if not self._stop.is_set():
                    say(f"hang watchdog (rank {self.rank}) stopped: {exc}", warning=True)
                return

    def _publish(self, idle: float, seq: int) -> None:
        beat = self.heartbeat
        pid, host = self._process
        self.store.set(f"{_PREFIX}/rank{self.rank}",
                       json.dumps([beat.step, beat.phase, round(idle, 2), seq, pid, host]))

    def _records(self) -> list[RankRecord]:
        # One multi_get a second once every rank has written (a rank still starting
        # has no key yet, and a get would wait for it).
        if len(self._present) < self.world_size:
            self._present = [k for k in (f"{_PREFIX}/rank{r}" for r in range(self.world_size))
                             if k in self._present or self.store.check([k])]
        present = self._present
        values = self.store.multi_get(present) if present else []
        # A record: [step, phase, idle, seq, pid, host] (_publish), after its rank.
        return [RankRecord(int(key.rsplit("rank", 1)[1]), *json.loads(raw))
                for key, raw in zip(present, values)]

    def _judge(self, now: float) -> None:
        records = self._records()
        stale: dict[int, float] = {}
        if now - self._started > self.slow_seconds:  # ranks that never reached the group
            have = {r.rank for r in records}
            for rank in range(self.world_size):
                if rank not in have:
                    records.append(RankRecord(rank, 0, SETUP, now - self._started, -1))
                    stale[rank] = now - self._started
        for r in records:
            seq, when = self._seen.get(r.rank, (None, now))
            if seq != r.seq:
                self._seen[r.rank] = (r.seq, now)
            elif r.phase not in (FINISHED, FAILED) and now - when > self.hang_seconds:
                stale[r.rank] = now - when  # frozen: named after hang_seconds, any phase
        if stale or any(r.idle > limit_of(r.phase, self.hang_seconds, self.slow_seconds)
                        and r.phase != FINISHED for r in records):
            report = hang_report(records, self.hang_seconds, stale, self.slow_seconds)
            frozen = [[r.rank, r.host, r.pid] for r in records
                      if r.rank in stale and r.seq >= 0 and r.pid]
            self.store.set(_FROZEN, json.dumps(frozen))
            mine = f"judge rank {self.rank}\n" + "\n".join(report)
            # The first judge's report stands; the other judge's is dropped.
            if self.store.compare_set(_HANG, "", mine).decode() == mine:
                self.report = report

    def _end(self) -> None:
        """Every live rank: its note for sailfin launch, its stack; the judge that reported:
        the report; then frozen ranks on this host are ended, and this process exits."""
        leave_note(HANG)  # first: torchrun may stop this process any moment from now
        beat = self.heartbeat
        header = (f"hang watchdog: stack of rank {self.rank} (global_step "
                  f"{recipe_step(beat.step, beat.phase)}, "
                  f"phase {beat.phase}, pid {os.getpid()})")
        _write_stack(header, sys.stderr)
        if self.report_dir:
            with contextlib.suppress(OSError):
                os.makedirs(self.report_dir, exist_ok=True)
                with open(os.path.join(self.report_dir, f"stack-rank{self.rank}.txt"),
                          "w") as fh:
                    _write_stack(header, fh)
        self.store.add(_ACKS, 1)
        wait = min(10.0, max(2.0, self.hang_seconds / 2))
        frozen = self._frozen()
        if self.report is not None:
            live = self.world_size - len(frozen)
            _wait_for(lambda: self.store.add(_ACKS, 0) >= live, wait)
            where = f" and to {self.report_dir}" if self.report_dir else ""
            ended = (f"; ended the frozen process(es) of rank "
                     f"{', '.join(str(f[0]) for f in frozen)}" if frozen else "")
            for line in [*self.report, f"every live rank wrote its stack to its stderr{where}"
                         f"{ended}; exiting with code {HANG_EXIT_CODE} (torchrun --max-restarts "
                         "restarts the job, which resumes from its last checkpoint)"]:
                say(line, warning=True)
            for handler in log.handlers:
                handler.flush()
            self.store.set(_DONE, "1")
            self._end_frozen(frozen)
            time.sleep(0.5)  # the others read it before this process (maybe the store's
            #                  host) goes
        else:
            # Under torchrun, the first worker to exit makes the agent stop the others:
            # let the judge print the report first.
            _wait_for(lambda: self.store.check([_DONE]), wait)
            self._end_frozen(frozen)
        self.on_hang(HANG_EXIT_CODE)

    def _frozen(self) -> list[list[Any]]:
        """The frozen ranks the report named: [rank, host, pid] each."""
        try:
            return json.loads(self.store.get(_FROZEN)) if self.store.check([_FROZEN]) else []
        except Exception:  # noqa: BLE001 - the report is what matters
            return []

    def _end_frozen(self, frozen: list[list[Any]]) -> None:
        """SIGKILL the frozen ranks' processes that run on this host (a stopped process
        takes no other signal; torchrun would wait 30 s for it), once the report is out."""
        pid, host = self._process
        for rank, their_host, their_pid in frozen:
            if their_host == host and their_pid != pid and rank != self.rank:
                with contextlib.suppress(OSError):  # gone already
                    os.kill(their_pid, signal.SIGKILL)


_PREFIX = "sailfin/watchdog"
_HANG = f"{_PREFIX}/hang"
_ACKS = f"{_PREFIX}/acks"
_DONE = f"{_PREFIX}/reported"
_FROZEN = f"{_PREFIX}/frozen"


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


class HangDetected(RuntimeError):
    """The hang watchdog found a rank that stopped making progress (raised in the main
    thread of a process that trains in-process, once the report is out)."""

    def __init__(self, message: str = (
            "the hang watchdog stopped this run: a rank made no progress (its report is "
            f"above); the sailfin command would exit {HANG_EXIT_CODE} here")) -> None:
        super().__init__(message)


def raise_in_main(code: int) -> None:
    """Raise :class:`HangDetected` in the main thread when it next runs Python code: an
    in-process run ends with an error its host can catch, never with the host's end.
    (A main thread blocked in C for good stays there: the host may interrupt it.)"""
    main = threading.main_thread().ident
    if main is not None and main != threading.get_ident():
        # CPython's documented C API for this; it takes the class, instantiated on raise.
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main),
                                                   ctypes.py_object(HangDetected))


def end_process(code: int) -> None:
    """Flush the logs and streams and end the process with ``code`` (the sailfin command's
    action on a hang: its main thread may be stuck in C, where nothing else reaches it)."""
    for handler in log.handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the main thread is stuck: only a hard exit ends the process


def resolve_hang_seconds(value: Any, world_size: int) -> Optional[float]:
    """``trainer.distributed.hang_seconds`` in seconds; None: off."""
    if value is None:
        return None
    if value == "auto":
        return AUTO_HANG_SECONDS if world_size > 1 else None
    return float(value)


def resolve_slow_seconds(value: Any, hang_seconds: float) -> float:
    """``trainer.distributed.hang_seconds_slow_phases`` in seconds."""
    if value == "auto":
        return 4 * hang_seconds
    return hang_seconds if value is None else max(float(value), hang_seconds)


def build_watchdog(hang_setting: Any, rank: int, world_size: int, store: Any,
                   heartbeat: Heartbeat, report_dir: Optional[str],
                   slow_setting: Any = "auto", end: bool = False) -> Optional[Watchdog]:
    """A started :class:`Watchdog` as ``trainer.distributed.hang_seconds`` asks, or None.
    ``store`` None (one process): a private store; ``end``: :func:`end_process` on a hang."""
    seconds = resolve_hang_seconds(hang_setting, world_size)
    if seconds is None:
        return None
    if store is None:
        import torch.distributed as dist
        store = dist.HashStore()
    dog = Watchdog(heartbeat, store, rank, world_size, seconds,
                   interval=min(1.0, seconds / 4), report_dir=report_dir,
                   slow_seconds=resolve_slow_seconds(slow_setting, seconds),
                   on_hang=end_process if end else raise_in_main)
    dog.start()
    return dog
