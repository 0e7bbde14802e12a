"""``trainer.val_every_n_steps``: validate inside an epoch, every N optimizer steps.

The schedule is a function of the global step alone (steps N, 2N, ...), so a
resumed run validates where the uninterrupted one would have. A run without
``val_every_n_steps`` has no such callback and pays nothing per step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..core.callbacks import Callback

if TYPE_CHECKING:
    from ..core.view import RunView


class StepValidation(Callback):
    """Calls ``trainer.validate()`` after every ``every``-th optimizer step.

    The time spent validating is not training time: it leaves ``train_seconds``
    and the throughput of the next train log line, as epoch-end validation does.

    Example::

        Trainer(module, args, callbacks=[StepValidation(500)]).train()  # or val_every_n_steps
    """

    def __init__(self, every: int) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = every

    def on_step_end(self, trainer: "RunView") -> None:
        if trainer.global_step % self.every:
            return
        started = time.perf_counter()
        trainer.validate()
        trainer.exclude_time(time.perf_counter() - started)
