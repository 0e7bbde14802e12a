"""The TensorBoard writer: scalars and hyper-parameters in TensorBoard event files.

Imported only when ``tensorboard`` is in ``trainer.writers`` (extra:
``pip install 'sailfin[tensorboard]'``).
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping

from torch.utils.tensorboard import SummaryWriter

from .destination import check_directory, destination_error
from .writers import Writer, scalars


class TensorBoardWriter(Writer):
    """Event files under ``log_dir`` (``<output_dir>/tensorboard``): scalars tagged
    ``<split>/<name>`` (``val/<dataset>/<name>`` with several validation sets),
    hyper-parameters in the HParams tab. TensorBoard's writer queues events and writes
    them from its own thread, so a step never waits for the disk.

    Example::

        w = TensorBoardWriter("outputs/run1/tensorboard")
        w.log_metrics({"loss": 0.5}, step=10, epoch=0, split="train")
        w.close()   # then: tensorboard --logdir outputs/run1/tensorboard
    """

    name = "tensorboard"

    def __init__(self, log_dir: str | os.PathLike, flush_seconds: float = 10.0) -> None:
        self.log_dir = os.fspath(log_dir)
        check_directory(self.log_dir, self.name)
        try:
            self._tb = SummaryWriter(self.log_dir, max_queue=100, flush_secs=flush_seconds)
        except OSError as exc:
            raise destination_error(self.name, self.log_dir, exc, "trainer.output_dir") from None

    def log_metrics(self, metrics, step, epoch, split):
        for tag, value in scalars(metrics, f"{split}/"):
            self._tb.add_scalar(tag, value, global_step=step)

    def log_run_totals(self, totals, step, epoch):
        self.log_metrics(totals, step, epoch, "time")  # time/goodput, time/replayed_seconds...

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        # HParams takes bool, int, float and str; None and lists become text.
        clean = {k: v if isinstance(v, (bool, int, float, str)) and not (
            isinstance(v, float) and not math.isfinite(v)) else str(v)
            for k, v in hparams.items()}
        # run_name="." keeps the hparams in this run's directory, not a timestamped one.
        self._tb.add_hparams(clean, {}, run_name=".")

    def flush(self):
        self._tb.flush()  # like close, nothing once closed

    def close(self):
        self._tb.close()
