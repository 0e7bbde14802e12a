"""Trainer callbacks: the named hooks through which sailfin's features (checkpoints,
progress, profiling...) and a user's watchers follow the loop. The recipe's own
callbacks live on the ModuleInterface."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from .view import RunView


class Callback:
    """Override what you need; every method does nothing by default.

    Example::

        class PrintEpochs(Callback):
            def on_epoch_end(self, trainer):
                print("finished epoch", trainer.epoch)

        Trainer(module, args, callbacks=[PrintEpochs()]).train()
    """

    #: True: the tensors of ``state_dict()`` keep their shapes for the whole run (EMA's
    #: averages): checkpoints write them with DCP beside the model. False: in ``trainer.pt``.
    state_in_dcp = False

    def on_train_start(self, trainer: "RunView") -> None: ...

    def on_step_begin(self, trainer: "RunView") -> None:
        """Before the first micro-batch of each optimizer step (also a step run again)."""

    def on_out_of_memory(self, trainer: "RunView") -> None:
        """The device ran out of memory in this step's micro-batches. Overriding this says
        the callback handles it (``on_backward_end`` then asks for the step again); with
        no callback that does, the error propagates."""

    def on_backward_end(self, trainer: "RunView", samples: int) -> bool:
        """After this step's micro-batches (``samples`` on this rank), before the optimizer
        step. Return True to run the step again from its first micro-batch (after
        ``trainer.replan``); later callbacks are then not called for this attempt."""
        return False

    def on_step_end(self, trainer: "RunView") -> None:
        """After each optimizer step; ``trainer.global_step`` counts it already."""

    def on_epoch_end(self, trainer: "RunView") -> None: ...

    def on_validation_end(self, trainer: "RunView", metrics: Mapping[str, Mapping[str, float]]
                          ) -> None:
        """``metrics`` is name of validation set -> its metrics."""

    def on_save_end(self, trainer: "RunView", kind: str, seconds: float) -> None:
        """After a save: ``kind`` is ``"checkpoint"`` (to disk) or ``"snapshot"`` (memory);
        ``seconds`` is how long training waited for it. With ``async_save``, a
        ``"checkpoint copy"`` follows before the next optimizer step: the further wait for
        the copy of the optimizers' state."""

    def on_train_end(self, trainer: "RunView") -> None: ...


def notify_save_end(trainer: "RunView", kind: str, seconds: float) -> None:
    """Call ``on_save_end`` on the callbacks that override it (the savers call this)."""
    for callback in trainer.callbacks:
        if type(callback).on_save_end is not Callback.on_save_end:
            callback.on_save_end(trainer, kind, seconds)
