"""``trainer.count_flops``: the FLOPs meter counts the first optimizer step, as a callback."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.callbacks import Callback
from .flops import FlopsMeter

if TYPE_CHECKING:
    from ..core.view import RunView


class FirstStepFlops(Callback):
    """Counts the FLOPs of the first step's forwards and backwards with ``meter``.

    A step run again (a smaller micro-batch after running out of memory) is
    counted afresh. Once a step is counted it leaves the loop (``remove_callback``).

    Example::

        Trainer(module, args, callbacks=[FirstStepFlops(FlopsMeter())]).train()
    """

    def __init__(self, meter: FlopsMeter) -> None:
        self.meter = meter

    def on_step_begin(self, trainer: "RunView") -> None:
        if self.meter.pending:
            self.meter.abort()  # an attempt that did not reach on_backward_end
            self.meter.start()

    def on_backward_end(self, trainer: "RunView", samples: int) -> bool:
        if self.meter.pending:
            self.meter.stop(samples)  # before the optimizer step: forwards and backwards
        return False

    def on_step_end(self, trainer: "RunView") -> None:
        if not self.meter.pending:  # counted: no call at all from the next step on
            trainer.remove_callback(self)
