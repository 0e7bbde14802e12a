"""Bad shard data: the one error type, where it happened, and the count of skipped samples."""

from __future__ import annotations

import os
import tempfile
import weakref
from typing import Optional


class ShardError(RuntimeError):
    """Bad or unreachable shard data. The message names the shard URL and, where one is
    involved, the sample key and byte offset, and says what to do.

    It takes the message as its only positional argument so that DataLoader workers
    can re-raise it in the main process unchanged.
    """

    def __init__(self, message: str, url: Optional[str] = None, key: Optional[str] = None,
                 offset: Optional[int] = None) -> None:
        super().__init__(message)
        self.url, self.key, self.offset = url, key, offset


class ShardURLError(ShardError, ValueError):
    """A shard list that names no shard, or one that is refused (``pipe:``)."""


def where(url: str, key: Optional[str] = None, offset: Optional[int] = None) -> str:
    """``shard URL, sample 'KEY' at byte N``: the start of every data error message."""
    text = f"shard {url}"
    if key is not None:
        text += f", sample '{key}'"
    if offset is not None:
        text += f" at byte {offset}"
    return text


class SharedCounter:
    """Counts events across processes: one byte appended to a small file per event.

    ``O_APPEND`` writes are atomic, so workers need no lock, and the counter pickles
    as a path, so it works with fork, spawn and forkserver workers alike (a
    ``multiprocessing.Value`` cannot cross contexts). The creator's garbage
    collection removes the file.

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
