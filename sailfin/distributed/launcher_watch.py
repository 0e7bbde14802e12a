"""A worker whose launcher is gone stops, as on a preemption (docs/robustness.md).

torchrun starts each worker in a process session of its own, so a ``kill -9`` of torchrun
(or of ``sailfin launch``, which runs it) reaches no worker: each trained on to the end,
writing checkpoints and the final model with no one watching or restarting it. A worker
learns of it from its parent process: the launcher is the parent of every worker it
starts, and when it dies the worker is handed to another (init, or a sub-reaper).

Example::

    watch = LauncherWatch(lambda pid: print(f"launcher {pid} is gone"))
    watch.start()      # a thread: one getppid() every half second
    ...
    watch.stop()
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Optional


# The parent when sailfin's command began (sailfin.signals imports this module first
# thing): the launcher, even if it dies while the worker still sets up.
_PARENT_AT_START = os.getppid()


def under_a_launcher() -> bool:
    """Whether torchrun (or ``sailfin launch``) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def launcher_pid() -> int:
    """The launcher's pid: this process's parent when sailfin's command began."""
    return _PARENT_AT_START


def parent_gone(parent: int, wait: float = 0.0) -> bool:
    """Whether this process's parent is no longer ``parent``, waiting up to ``wait``
    seconds for it (a dying launcher closes its sockets before its children are handed
    on: a worker may see the broken store first)."""
    deadline = time.monotonic() + wait
    while os.getppid() == parent:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


class LauncherWatch:
    """Calls ``on_gone(launcher_pid)`` once, from a thread, when the launcher that started
    this process exits. The launcher is the parent when the command began (or
    ``parent``)."""

    def __init__(self, on_gone: Callable[[int], None], interval: float = 0.5,
                 parent: Optional[int] = None) -> None:
        self.on_gone = on_gone
        self.interval = interval
        self.parent = launcher_pid() if parent is None else parent
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._told = False
        self._lock = threading.Lock()  # the thread and the loop may look at once

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="sailfin-launcher-watch",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None

    def check(self) -> bool:
        """Look now (the loop, before the ranks agree); True once the launcher is gone."""
        with self._lock:
            if not self._told and parent_gone(self.parent):
                self._told = True
                self.on_gone(self.parent)
            return self._told

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self.check():
                return
