"""A count shared by a process and its DataLoader workers, however they were started."""

from __future__ import annotations

import os
import tempfile
import weakref


class SharedCounter:
    """Counts events across processes: one byte appended to a small file per event.

    Appends with ``O_APPEND`` are atomic, so workers need no lock, and the
    counter pickles as a path, so it works with fork, spawn and forkserver
    workers alike (a ``multiprocessing.Value`` cannot cross contexts). The file
    is removed when the counter that created it is garbage-collected.

    Example::

        counter = SharedCounter()
        counter.add()          # in any process that received the counter
        counter.value          # 1
    """

    def __init__(self) -> None:
        fd, self.path = tempfile.mkstemp(prefix="sailfin-count-")
        os.close(fd)
        self._finalizer = weakref.finalize(self, _remove, self.path, os.getpid())

    def add(self) -> int:
        """Count one event; return the count so far (for log messages)."""
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, b"\1")
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    @property
    def value(self) -> int:
        try:
            return os.stat(self.path).st_size
        except FileNotFoundError:
            return 0

    def __getstate__(self) -> dict:
        return {"path": self.path}  # copies never delete the file

    def __setstate__(self, state: dict) -> None:
        self.path = state["path"]


def _remove(path: str, creator: int) -> None:
    if os.getpid() == creator:  # not in a forked worker holding a copy
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
