"""A writer that appends lines to one file: the shared part of the JSONL and CSV writers."""

from __future__ import annotations

import os
import time
from typing import Optional

from .destination import check_directory, destination_error
from .writers import Writer


class TextFileWriter(Writer):
    """Opens ``path`` for appending at start-up (so a bad destination fails then) and
    flushes after an event at most every ``flush_seconds`` (0: after every event).

    Subclasses write in :meth:`log_metrics` and call :meth:`_written` after each
    event; :meth:`_start` writes a header into an empty file.
    """

    name = "file"

    def __init__(self, path: "str | os.PathLike", flush_seconds: float = 0.0,
                 newline: Optional[str] = None) -> None:
        self.path = os.fspath(path)
        check_directory(os.path.dirname(self.path) or ".", self.name)
        try:
            self._fh = open(self.path, "a", encoding="utf-8", newline=newline)
            self._start(new=self._fh.tell() == 0)
            self._fh.flush()
        except OSError as exc:
            self._close_quietly()
            raise destination_error(self.name, self.path, exc, "trainer.output_dir") from None
        self.flush_seconds = flush_seconds
        self._last_flush = time.monotonic()

    def _start(self, new: bool) -> None:
        """Write what an empty file begins with (nothing by default)."""

    def _written(self) -> None:
        if self.flush_seconds <= 0:
            self.flush()
            return
        now = time.monotonic()
        if now - self._last_flush >= self.flush_seconds:
            self.flush()
            self._last_flush = now

    def flush(self):
        if not self._fh.closed:
            try:
                self._fh.flush()
            except OSError as exc:
                raise destination_error(self.name, self.path, exc,
                                        "trainer.output_dir") from None

    def close(self):
        if not getattr(self, "_fh", None) or self._fh.closed:
            return
        try:
            self.flush()
        finally:
            self._close_quietly()

    def __del__(self) -> None:
        # A trainer that was never closed: everything was flushed when train()
        # ended; close the file with the writer instead of leaving it to the GC.
        self._close_quietly()

    def _close_quietly(self) -> None:
        fh = getattr(self, "_fh", None)
        if fh is not None and not fh.closed:
            try:
                fh.close()
            except OSError:
                pass  # the flush already reported the failure
