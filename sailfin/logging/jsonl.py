"""The JSONL writer: ``metrics.jsonl``, the file ``sailfin report`` reads."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from .textfile import TextFileWriter


def jsonable(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as null."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


class JsonlWriter(TextFileWriter):
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
        super().__init__(path, flush_seconds)

    def log_metrics(self, metrics, step, epoch, split):
        record = {"step": step, "epoch": epoch, "split": split}
        for k, v in metrics.items():
            record[k] = jsonable(v)
        self._fh.write(json.dumps(record) + "\n")
        self._written()
