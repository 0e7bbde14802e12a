"""Signals outside the training loop: a SIGTERM during set-up, and the note a preempted
worker leaves for ``sailfin launch``.

Inside the loop, :mod:`sailfin.trainer.preemption` turns SIGTERM into a checkpoint
and exit code 75. Before it takes over (imports, building the model, joining the
process group, reading the data), SIGTERM's default action would end the process
with a bare -15. :func:`stop_during_setup` instead ends it with one line and the
same code 75: nothing was trained since the last checkpoint, so running the same
command again loses nothing.

Example::

    with stop_during_setup():
        module = cfg.build()          # a SIGTERM here raises StoppedDuringSetup
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any, Iterator

from .distributed.exit_codes import PREEMPTED_EXIT_CODE  # noqa: F401 (sailfin launch reads it here)

LAUNCH_DIR_ENV = "SAILFIN_LAUNCH_DIR"
"""Set by ``sailfin launch`` for its workers: where each preempted worker leaves a note."""


class StoppedDuringSetup(BaseException):
    """SIGTERM arrived before the first step. A BaseException, like KeyboardInterrupt, so
    that no ``except Exception`` in set-up code swallows it."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"stopped by {signal_name} during set-up, before the first step; "
                         "nothing was lost: run the same command again to start (or resume)")
        self.signal_name = signal_name


@contextlib.contextmanager
def stop_during_setup() -> Iterator[None]:
    """Until the block ends (or the trainer installs its own handler), SIGTERM raises
    :class:`StoppedDuringSetup`; the previous handler is restored afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, previous)  # once: a repeated SIGTERM is the same stop
        raise StoppedDuringSetup(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    _installed.append((on_sigterm, previous))
    try:
        yield
    finally:
        _installed.remove((on_sigterm, previous))
        if signal.getsignal(signal.SIGTERM) is on_sigterm:
            signal.signal(signal.SIGTERM, previous)


_installed: list[tuple[Any, Any]] = []


def setup_over() -> None:
    """Training ran (or failed): SIGTERM gets its previous action back, also where the
    trainer's handler, on leaving, put the set-up handler back."""
    for handler, previous in _installed:
        if signal.getsignal(signal.SIGTERM) is handler:
            signal.signal(signal.SIGTERM, previous)


def note_preempted() -> None:
    """Under ``sailfin launch``: record that this worker saved and stopped on a signal, so
    that the launcher can exit 75 when every worker did."""
    where = os.environ.get(LAUNCH_DIR_ENV)
    if not where:
        return
    rank = os.environ.get("RANK", str(os.getpid()))
    with contextlib.suppress(OSError):
        with open(os.path.join(where, f"preempted-rank{rank}"), "w") as fh:
            fh.write(f"{os.getpid()}\n")
