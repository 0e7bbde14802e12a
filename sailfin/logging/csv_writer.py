"""The CSV writer: ``metrics.csv`` in long form (one row per value)."""

from __future__ import annotations

import csv
import math
import numbers
import os

from .textfile import TextFileWriter

COLUMNS = ("step", "epoch", "split", "name", "value")


class CsvWriter(TextFileWriter):
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
        super().__init__(path, flush_seconds, newline="")

    def _start(self, new: bool) -> None:
        self._csv = csv.writer(self._fh)
        if new:
            self._csv.writerow(COLUMNS)

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
        self._written()
