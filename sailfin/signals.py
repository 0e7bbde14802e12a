"""Signals outside the training loop: SIGTERM or Ctrl-C during set-up, and the notes a
worker leaves for ``sailfin launch``.

Inside the loop, :mod:`sailfin.trainer.preemption` turns SIGTERM (or a first Ctrl-C)
into a checkpoint and exit code 75. Before it takes over, :func:`stop_during_setup` makes
such a stop one line and the same 75 (nothing was trained since the last checkpoint),
not a bare -15 or a ``KeyboardInterrupt``. A main thread blocked in C (a collective
waiting for a peer) never runs Python's handler, so a helper thread learns of the
signal through :func:`signal.set_wakeup_fd` and ends the process itself after
:data:`STUCK_SECONDS` (docs/robustness.md).

Example::

    with stop_during_setup():
        module = cfg.build()          # a SIGTERM here raises StoppedDuringSetup
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any, Iterator, Optional

from .distributed.exit_codes import PREEMPTED_EXIT_CODE
from .distributed.launch_notes import LAUNCH_DIR_ENV, PREEMPTED, clear_notes, leave_note
from .distributed.launcher_watch import launcher_pid  # noqa: F401 (notes the launcher now)

__all__ = ["LAUNCH_DIR_ENV", "PREEMPTED_EXIT_CODE", "StoppedDuringSetup", "default_signals",
           "note_preempted", "raise_swallowed_stop", "setup_over", "stop_at_start",
           "stop_during_setup"]

STUCK_SECONDS = 5.0
"""How long set-up may take to unwind after a stop signal before the process ends anyway."""
# torchrun's agent passes a Ctrl-C it received on to its workers, which got the same
# Ctrl-C from the terminal: a second SIGINT this soon is that copy, not a second press.
_SAME_PRESS_SECONDS = 1.0
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StoppedDuringSetup(BaseException):
    """SIGTERM (or a first Ctrl-C) arrived before the first step. A BaseException, like
    KeyboardInterrupt, so that no ``except Exception`` in set-up code swallows it."""

    def __init__(self, signal_name: str, after_start: bool = False,
                 message: Optional[str] = None) -> None:
        super().__init__(message or (
            f"stopped by {signal_name} after training had begun, as the run was ending; the "
            "checkpoints saved are intact: run the same command again to resume from the "
            "latest" if after_start else
            f"stopped by {signal_name} during set-up, before the first step; nothing was "
            "lost: run the same command again to start (or resume)"))
        self.signal_name = signal_name
        # True when training had begun (a SIGTERM while a rank stops on an error, after
        # the loop's own handler left): ``message`` (or the caller) says what was lost.
        self.after_start = after_start


class _SetupStop:
    """The set-up handler of SIGTERM and SIGINT, and the thread that ends a stuck set-up
    (``end_stuck``: only in a process of its own, the sailfin command; in-process a stuck
    set-up is left to its host, and every handler is put back when the block ends)."""

    def __init__(self, end_stuck: bool = False) -> None:
        self.end_stuck = end_stuck
        self.first: Optional[tuple[str, float]] = None  # the first stop: signal, when
        self.over = False  # training began: no longer set-up (the loop's handler returns
        #                    this one when it leaves)
        self.done = threading.Event()
        self.previous: dict[int, Any] = {}
        self._pipe: Optional[tuple[int, int]] = None
        self._thread: Optional[threading.Thread] = None

    def on_signal(self, signum: int, frame: Any) -> None:
        if self.over:  # training began: put back what was there, and let it act
            previous = self.previous.get(signum, signal.SIG_DFL)
            # The default action would end us without a word; in the sailfin command
            # (end_stuck) the handler before is the command's start one, which knows no
            # training: either way this stop comes after the first step.
            if not callable(previous) or self.end_stuck:
                raise StoppedDuringSetup(signal.Signals(signum).name, after_start=True)
            signal.signal(signum, previous)
            os.kill(os.getpid(), signum)
            return
        name, now = signal.Signals(signum).name, time.monotonic()
        if self.first is None:
            self.first = (name, now)
            if self.end_stuck and _in_import(frame):
                _end_setup(name)
            raise StoppedDuringSetup(name)
        if signum == signal.SIGINT and now - self.first[1] > _SAME_PRESS_SECONDS:
            raise KeyboardInterrupt  # a second Ctrl-C: abort
        # Else the same stop again: torchrun's copy of a Ctrl-C, a repeated SIGTERM.

    def install(self) -> None:
        for sig in _SIGNALS:
            self.previous[sig] = signal.signal(sig, self.on_signal)
        if not self.end_stuck:
            return  # in-process: no thread that could end the host
        read, write = os.pipe()
        os.set_blocking(write, False)
        old = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        if old != -1:  # someone else's (an event loop): leave it to them
            signal.set_wakeup_fd(old)
            os.close(read)
            os.close(write)
            return
        self._pipe = (read, write)
        self._thread = threading.Thread(target=self._watch, args=(read,), daemon=True,
                                        name="sailfin-setup-signals")
        self._thread.start()

    def uninstall(self) -> None:
        """Restore the previous handlers, unless a stop came: then copies of it that are
        still on their way must not reach the default handlers (a traceback)."""
        self.done.set()
        if self._pipe is not None:
            signal.set_wakeup_fd(-1)
            read, write = self._pipe
            with contextlib.suppress(OSError):
                os.write(write, b"\0")  # wakes the thread, which sees done and leaves
            self._thread.join()
            os.close(read)
            os.close(write)
            self._pipe = None
        if self.first is None or not self.end_stuck:  # in-process: the host's handlers back
            self._put_back()

    def _watch(self, read: int) -> None:
        while not self.done.is_set():
            try:
                data = os.read(read, 64)
            except OSError:
                return
            stops = [b for b in data if b in _SIGNALS and not self.over and
                     signal.getsignal(b) == self.on_signal]  # set-up's, not the loop's
            if stops and not self.done.wait(STUCK_SECONDS):
                name = self.first[0] if self.first else signal.Signals(stops[0]).name
                _end_setup(name)

    def restore(self) -> None:
        """Training began (or ran): set-up is over, the signals get their previous actions
        back (also later, when the loop's handler returns this one)."""
        self.over = True
        if not self.end_stuck:  # in-process: the host's handlers back
            self._put_back()
        # The sailfin command keeps this handler (when the loop's returns it): the one
        # before it, the command's start handler, would call a stop "during set-up".

    def _put_back(self) -> None:
        for sig, handler in self.previous.items():
            if signal.getsignal(sig) == self.on_signal:
                signal.signal(sig, handler)


def _end_setup(name: str) -> None:
    """End the process here (the sailfin command only): its main thread is blocked in C
    (a collective waiting for a peer), or imports (:func:`_in_import`)."""
    note_preempted()
    _end_now(f"sailfin: {StoppedDuringSetup(name)} (exit code {PREEMPTED_EXIT_CODE})")


def _end_now(line: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, f"{line}\n".encode())  # not sys.stderr: the main thread may hold its lock
    os._exit(PREEMPTED_EXIT_CODE)


def _in_import(frame: Any) -> bool:
    """Whether the signal came while a module imports. An exception raised there can meet
    a bare ``except:`` (dill's) or a module that torch's C++ start-up imports, where
    pybind11 aborts the process. Ending there skips set-up's unwinding, as a set-up stuck
    in C does (a memory snapshot directory it claimed is its next run's to reuse)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def stop_during_setup(end_stuck: bool = False) -> Iterator[None]:
    """Until the block ends (or the trainer installs its own handler), SIGTERM or a first
    Ctrl-C raises :class:`StoppedDuringSetup`; with ``end_stuck`` (the sailfin command, a
    process of its own) a set-up blocked in C ends the process with 75 after
    :data:`STUCK_SECONDS`. The previous handlers are restored afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    clear_notes()  # a worker torchrun restarted: its notes are this attempt's
    stop = _SetupStop(end_stuck)
    stop.install()
    _installed.append(stop)
    try:
        yield
    except Exception as exc:
        if stop.first is None or stop.over:
            raise
        # Set-up code swallowed the stop (a bare ``except:``), then failed on its work.
        raise StoppedDuringSetup(stop.first[0]) from exc
    finally:
        _installed.remove(stop)
        stop.uninstall()


_installed: list[_SetupStop] = []


def raise_swallowed_stop() -> None:
    """Raise a stop of set-up (or of the command's start, :func:`stop_at_start`) again, at
    a point of sailfin's own, if code it called swallowed it (a bare ``except:``): no step
    may run after a stop."""
    if _started_stops:
        raise StoppedDuringSetup(_started_stops[0])
    for stop in _installed:
        if stop.first is not None and not stop.over:
            raise StoppedDuringSetup(stop.first[0])


def stop_at_start() -> None:
    """The sailfin command's first instruction: from here on SIGTERM or Ctrl-C raises
    :class:`StoppedDuringSetup` (one line and exit 75 where the command catches it), or
    ends the process with that line while a module imports (:func:`_in_import`); never a
    ``KeyboardInterrupt`` traceback or a bare -15. Copies of the same stop that arrive
    while it unwinds are ignored. Each command then installs
    its own handlers (:func:`stop_during_setup`, torchrun's) or :func:`default_signals`."""
    first: list[str] = []

    def on_signal(signum: int, frame: Any) -> None:
        if first:
            return
        first.append(signal.Signals(signum).name)
        _started_stops.append(first[0])  # raise_swallowed_stop: until the process ends
        if _in_import(frame):  # torch's, under sailfin launch: no worker, no file yet
            _end_now(f"{'sailfin launch' if sys.argv[1:2] == ['launch'] else 'sailfin'}: "
                     f"stopped by {first[0]} while starting, before any work began: "
                     "nothing was lost; run the same command again (exit code "
                     f"{PREEMPTED_EXIT_CODE})")
        raise StoppedDuringSetup(first[0])

    for sig in _SIGNALS:
        signal.signal(sig, on_signal)


# The stops stop_at_start's handler raised in this process (the sailfin command's).
_started_stops: list[str] = []


def default_signals() -> None:
    """SIGTERM and SIGINT back to Python's own actions (a command that handles no stop)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def setup_over() -> None:
    """Training began, ran or failed: set-up is over. SIGTERM and SIGINT get their previous
    actions back, also where the trainer's handler, on leaving, put the set-up handler
    back (a SIGTERM while a failed run tears down is no stop "during set-up")."""
    for stop in _installed:
        stop.restore()


def note_preempted() -> None:
    """Under ``sailfin launch``: record that this worker saved and stopped on a signal (or
    stopped before its first step), so that the launcher can exit 75 when every worker did."""
    leave_note(PREEMPTED)
