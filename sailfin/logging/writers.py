"""Writers: where logged metrics go. A base that does nothing, and a list of them.

Only rank 0 builds writers. Each opens what it writes at start-up, so a bad
path fails before training starts, not hours in.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import IO, Any, Iterable, Mapping, Optional


class Writer:
    """Receives logged events. Subclass and override what you need."""

    def log_metrics(self, metrics: Mapping[str, float], step: int, epoch: int,
                    split: str) -> None:
        pass

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.flush()


class Writers(Writer):
    """Forwards every call to each writer in order."""

    def __init__(self, writers: Iterable[Writer] = ()) -> None:
        self.writers = list(writers)

    def log_metrics(self, metrics, step, epoch, split):
        for w in self.writers:
            w.log_metrics(metrics, step, epoch, split)

    def log_hparams(self, hparams):
        for w in self.writers:
            w.log_hparams(hparams)

    def flush(self):
        for w in self.writers:
            w.flush()

    def close(self):
        for w in self.writers:
            w.close()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != 0 and abs(value) < 1e-3:
            return f"{value:.3e}"
        return f"{value:.1f}" if abs(value) >= 1000 else f"{value:.4f}"
    return str(value)


class StdoutWriter(Writer):
    """One readable line per event: ``[train] epoch 0 step 20 | loss 0.4321 | ...``.

    Validation lines are flushed at once; training lines at most once a second
    (a flush is a system call, and a log file or pipe does not need every line
    the moment it is written).
    """

    def __init__(self, stream: Optional[IO[str]] = None, flush_seconds: float = 1.0) -> None:
        self.stream = stream
        self.flush_seconds = flush_seconds
        self._last_flush = time.monotonic()

    def log_metrics(self, metrics, step, epoch, split):
        stream = self.stream or sys.stdout
        body = " | ".join(f"{k} {_fmt(v)}" for k, v in metrics.items())
        stream.write(f"[{split}] epoch {epoch} step {step} | {body}\n")
        now = time.monotonic()
        if split != "train" or now - self._last_flush >= self.flush_seconds:
            stream.flush()
            self._last_flush = now

    def flush(self):
        (self.stream or sys.stdout).flush()


class JsonlWriter(Writer):
    """``metrics.jsonl``: one JSON object per event with step, epoch and split.

    Lines are buffered and flushed at least every ``flush_seconds`` and at close.
    Non-finite floats are written as null (JSON has no NaN).
    """

    def __init__(self, path: str | os.PathLike, flush_seconds: float = 2.0) -> None:
        self.path = os.fspath(path)
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")
        except OSError as exc:
            raise OSError(f"jsonl writer cannot open {self.path}: {exc.strerror}; "
                          "check trainer.output_dir") from None
        self.flush_seconds = flush_seconds
        self._last_flush = time.monotonic()

    def log_metrics(self, metrics, step, epoch, split):
        record = {"step": step, "epoch": epoch, "split": split}
        for k, v in metrics.items():
            record[k] = None if isinstance(v, float) and not math.isfinite(v) else v
        self._fh.write(json.dumps(record) + "\n")
        now = time.monotonic()
        if now - self._last_flush >= self.flush_seconds:
            self.flush()
            self._last_flush = now

    def flush(self):
        if not self._fh.closed:
            self._fh.flush()

    def close(self):
        if not self._fh.closed:
            self._fh.close()


def build_writers(names: Iterable[str], output_dir: str) -> Writers:
    """Writers named in ``trainer.writers``; heavy ones are imported only when chosen."""
    writers: list[Writer] = []
    for name in names:
        if name == "stdout":
            writers.append(StdoutWriter())
        elif name == "jsonl":
            writers.append(JsonlWriter(os.path.join(output_dir, "metrics.jsonl")))
        else:  # the config already rejected unknown names
            raise ValueError(f"unknown writer {name!r}")
    return Writers(writers)
