"""Trainer callbacks: components (checkpoints, progress, profiling) that follow the loop.

The recipe's own callbacks live on the ModuleInterface; these are for pieces
of sailfin and for users who want to watch a run without touching the recipe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from .trainer import Trainer


class Callback:
    """Override what you need; every method does nothing by default.

    Example::

        class PrintEpochs(Callback):
            def on_epoch_end(self, trainer):
                print("finished epoch", trainer.epoch)

        Trainer(module, args, callbacks=[PrintEpochs()]).train()
    """

    def on_train_start(self, trainer: "Trainer") -> None: ...

    def on_step_end(self, trainer: "Trainer") -> None:
        """After each optimizer step; ``trainer.global_step`` counts it already."""

    def on_epoch_end(self, trainer: "Trainer") -> None: ...

    def on_validation_end(self, trainer: "Trainer", metrics: Mapping[str, Mapping[str, float]]
                          ) -> None:
        """``metrics`` is name of validation set -> its metrics."""

    def on_train_end(self, trainer: "Trainer") -> None: ...
