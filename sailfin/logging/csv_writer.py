"""The CSV writer: ``metrics.csv`` in long form (one row per value)."""

from __future__ import annotations

import csv
import math
import numbers
import os
import time

from .destination import check_directory, destination_error
from .writers import Writer

COLUMNS = ("step", "epoch", "split", "name", "value")


class CsvWriter(Writer):
    """``metrics.csv`` with columns ``step, epoch, split, name, value``.

    One row per value keeps the header fixed while the set of metrics changes
    (training and validation log different names); a spreadsheet pivot or
    ``pandas.read_csv(...).pivot_table(index="step", columns="name")`` turns it
    wide. A validation set's name prefixes its metrics (``test/accuracy``) when
    there are several. Non-numeric values are left out; non-finite ones are
    written as ``nan``/``inf``. The header is written and flushed at start-up,
    so an unwritable destination fails before training.

    Example::

        w = CsvWriter("outputs/run1/metrics.csv")
        w.log_metrics({"loss": 0.5, "lr": 0.1}, step=10, epoch=0, split="train")
        w.close()
    """

    name = "csv"

    def __init__(self, path: str | os.PathLike, flush_seconds: float = 2.0) -> None:
        self.path = os.fspath(path)
        check_directory(os.path.dirname(self.path) or ".", self.name)
        try:
            new = not os.path.exists(self.path) or os.path.getsize(self.path) == 0
            self._fh = open(self.path, "a", encoding="utf-8", newline="")
            self._csv = csv.writer(self._fh)
            if new:
                self._csv.writerow(COLUMNS)
            self._fh.flush()
        except OSError as exc:
            self._close_quietly()
            raise destination_error(self.name, self.path, exc, "trainer.output_dir") from None
        self.flush_seconds = flush_seconds
        self._last_flush = time.monotonic()

    def log_metrics(self, metrics, step, epoch, split):
        dataset = metrics.get("dataset")
        prefix = f"{dataset}/" if isinstance(dataset, str) else ""
        for key, value in metrics.items():
            if key == "dataset" or isinstance(value, bool) or not isinstance(
                    value, numbers.Real):
                continue
            value = float(value)
            text = repr(value) if math.isfinite(value) else str(value)
            self._csv.writerow((step, epoch, split, prefix + key, text))
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

    def _close_quietly(self) -> None:
        fh = getattr(self, "_fh", None)
        if fh is not None and not fh.closed:
            try:
                fh.close()
            except OSError:
                pass  # the flush already reported the failure
