"""The writers that append lines to one file: ``metrics.jsonl`` (the file ``sailfin
report`` reads) and ``metrics.csv``."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import time
from typing import Optional

from .destination import check_directory, destination_error
from .writers import Writer, scalars


class TextFileWriter(Writer):
    """The shared part: opens ``path`` for appending at start-up (so a bad destination
    fails then) and flushes after an event at most every ``flush_seconds`` (0: after
    every event). Subclasses write in :meth:`log_metrics` and call :meth:`_written`
    after each event; :meth:`_start` writes a header into an empty file."""

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
        if self.flush_seconds <= 0:  # every event: no clock to read
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
            with contextlib.suppress(OSError):  # the flush already reported the failure
                fh.close()


class JsonlWriter(TextFileWriter):
    """``metrics.jsonl``: one JSON object per event with step, epoch and split. Each event
    reaches the operating system as it is logged, so a killed process loses none (a
    resumed run reads how far it had come); ``flush_seconds`` > 0 batches writes instead.

    Example::

        w = JsonlWriter("outputs/run1/metrics.jsonl")
        w.log_metrics({"loss": 0.5}, step=10, epoch=0, split="train")
        w.close()
    """

    name = "jsonl"

    def log_metrics(self, metrics, step, epoch, split):
        record = {"step": step, "epoch": epoch, "split": split}
        for k, v in metrics.items():  # JSON has no NaN or infinity: null
            record[k] = None if isinstance(v, float) and not math.isfinite(v) else v
        self._fh.write(json.dumps(record) + "\n")
        self._written()


COLUMNS = ("step", "epoch", "split", "name", "value")


class CsvWriter(TextFileWriter):
    """``metrics.csv`` with columns ``step, epoch, split, name, value``: one row per value
    keeps the header fixed while the metrics change (``pandas.read_csv(...).pivot_table(
    index="step", columns="name")`` turns it wide). With several validation sets, the
    set's name prefixes its metrics (``test/accuracy``). Non-numeric values are left out;
    non-finite ones are written as ``nan``/``inf``.

    Example::

        w = CsvWriter("outputs/run1/metrics.csv")
        w.log_metrics({"loss": 0.5, "lr": 0.1}, step=10, epoch=0, split="train")
        w.close()
    """

    name = "csv"

    def __init__(self, path: str | os.PathLike, flush_seconds: float = 2.0) -> None:
        super().__init__(path, flush_seconds, newline="")

    def _start(self, new: bool) -> None:
        self._csv = csv.writer(self._fh)
        if new:
            self._csv.writerow(COLUMNS)

    def log_metrics(self, metrics, step, epoch, split):
        for name, value in scalars(metrics):
            text = repr(value) if math.isfinite(value) else str(value)
            self._csv.writerow((step, epoch, split, name, text))
        self._written()
