"""The JSONL writer: ``metrics.jsonl``, the file ``sailfin report`` reads."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

from .destination import check_directory, destination_error
from .writers import Writer


def jsonable(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as null."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


class JsonlWriter(Writer):
    """``metrics.jsonl``: one JSON object per event with step, epoch and split.

    Each event reaches the operating system as it is logged (one write every
    ``log_every_n_steps``), so a killed process loses none: a resumed run
    reads from it how far the run had come. ``flush_seconds`` > 0 batches
    writes instead. Non-finite floats are written as null (JSON has no NaN).

    Example::

        w = JsonlWriter("outputs/run1/metrics.jsonl")
        w.log_metrics({"loss": 0.5}, step=10, epoch=0, split="train")
        w.close()
    """

    name = "jsonl"

    def __init__(self, path: str | os.PathLike, flush_seconds: float = 0.0) -> None:
        self.path = os.fspath(path)
        check_directory(os.path.dirname(self.path) or ".", self.name)
        try:
            self._fh = open(self.path, "a", encoding="utf-8")
        except OSError as exc:
            raise destination_error(self.name, self.path, exc, "trainer.output_dir") from None
        self.flush_seconds = flush_seconds
        self._last_flush = time.monotonic()

    def log_metrics(self, metrics, step, epoch, split):
        record = {"step": step, "epoch": epoch, "split": split}
        for k, v in metrics.items():
            record[k] = jsonable(v)
        self._fh.write(json.dumps(record) + "\n")
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
        if not self._fh.closed:
            try:
                self.flush()
            finally:
                try:
                    self._fh.close()
                except OSError:
                    pass  # the flush above already reported it
