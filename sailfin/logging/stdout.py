"""The stdout writer: one readable line per logged event."""

from __future__ import annotations

import sys
import time
from typing import IO, Any, Callable, Union

from .writers import Writer


def format_value(value: Any) -> str:
    """Short, aligned-enough text for a metric: 4 decimals, scientific when tiny."""
    if isinstance(value, float):
        if value != 0 and abs(value) < 1e-3:
            return f"{value:.3e}"
        return f"{value:.1f}" if abs(value) >= 1000 else f"{value:.4f}"
    return str(value)


_FLOP_UNITS = (("TFLOP/s", 1.0), ("GFLOP/s", 1e-3), ("MFLOP/s", 1e-6), ("kFLOP/s", 1e-9))


def flop_rate(tflops: float) -> str:
    """Model FLOP/s in a unit that reads: 0.5 -> '500 GFLOP/s'; 7.4e-05 -> '74 MFLOP/s'.
    The one form the stdout lines, the progress display and the summary show."""
    for unit, scale in _FLOP_UNITS:  # (no call to flop_unit: this runs at every log)
        if tflops >= scale:
            return f"{tflops / scale:.3g} {unit}"
    return f"{tflops * 1e12:.3g} FLOP/s"


def flop_unit(tflops: float) -> tuple[str, float]:
    """The FLOP/s unit ``tflops`` reads best in, and TFLOP/s per that unit."""
    for unit, scale in _FLOP_UNITS:
        if tflops >= scale:
            return unit, scale
    return "FLOP/s", 1e-12


def _shown(key: str, value: Any) -> str:
    if key == "tflops" and isinstance(value, (int, float)):  # logged in TFLOP/s
        return flop_rate(value)
    if key == "mfu" and isinstance(value, (int, float)):
        return f"MFU {100 * value:.1f}%"
    return f"{key} {format_value(value)}"


class StdoutWriter(Writer):
    """One readable line per event: ``[train] epoch 1 step 20 | loss 0.4321 | ...``.

    Epochs are counted from 1, as on the progress bar and in metrics.jsonl (the trainer
    passes them so). Validation lines are flushed at once, training lines at most once a
    second (a flush is a system call). ``stream`` is a file, or a function returning one
    (looked up at each write, so a progress bar can print above itself).

    Example::

        Trainer(module, args, writers=[StdoutWriter()]).train()
    """

    def __init__(self, stream: Union[IO[str], Callable[[], IO[str]], None] = None,
                 flush_seconds: float = 1.0) -> None:
        self.stream = stream
        self.flush_seconds = flush_seconds
        self._last_flush = time.monotonic()

    def _stream(self) -> IO[str]:
        if self.stream is None:
            return sys.stdout
        return self.stream() if callable(self.stream) else self.stream

    def log_metrics(self, metrics, step, epoch, split):
        stream = self._stream()
        body = " | ".join(_shown(k, v) for k, v in metrics.items())
        stream.write(f"[{split}] epoch {epoch} step {step} | {body}\n")
        now = time.monotonic()
        if split != "train" or now - self._last_flush >= self.flush_seconds:
            stream.flush()
            self._last_flush = now

    def flush(self):
        self._stream().flush()
