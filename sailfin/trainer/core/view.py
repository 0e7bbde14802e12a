"""What a feature may read and call on the run: the door between the loop and the
modules in ``trainer/features``, ``trainer/checkpointing`` and ``trainer/safety``; a
feature that needs more adds it here, with a line saying what it is (and to
docs/architecture.md: ``tests/test_architecture.py`` checks both).

Example::

    class StopAtLoss(Callback):
        def on_step_end(self, trainer: RunView) -> None:
            if trainer.global_step >= 100:
                trainer.stop_reason = {"reason": "enough", "step": trainer.global_step}
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Protocol

import torch

from ...backends.strategy import SingleDevice
from ...checkpoint import Checkpointer, Loaded
from ...config.trainer import TrainerArguments
from ...data.plan import BatchPlan
from ...distributed import DistEnv
from ...distributed.watchdog import Heartbeat
from ...interfaces import ModuleInterface
from ...logging.writers import Writers
from .callbacks import Callback


class LossGuard(Protocol):
    """What the loop asks of the non-finite loss guard (safety/nonfinite.py)."""

    count: int                       # non-finite steps seen so far

    def observe(self, loss: torch.Tensor, global_step: int, epoch: int, step: int) -> bool:
        """True: go on with this optimizer step; False: skip it."""

    def check(self) -> None:
        """Raise now for a loss found non-finite but not yet read (the deferred guard)."""


class StopSignal(Protocol):
    """What the loop asks of the preemption flag (safety/preemption.py)."""

    check_at: int                    # the global step from which poll() is worth calling
    signal_name: Optional[str]       # the signal received, if any

    def poll(self, global_step: int) -> bool:
        """True: every rank stops after this step."""

    def save_and_stop(self, trainer: Any) -> None:
        """Save this step on every rank and raise TrainingPreempted."""


class StepFlops(Protocol):
    """What the run asks of the FLOPs meter (features/flops.py)."""

    def abort(self) -> None:
        """Leave the counting mode (an error inside the counted step)."""


class RunView(Protocol):
    """The run as a feature sees it (grouped as in docs/architecture.md)."""

    # -- the recipe and where it runs --------------------------------------------------
    module: ModuleInterface          # the recipe (its model, train_step, callbacks, get_state)
    args: TrainerArguments           # the trainer settings in effect
    dist: DistEnv                    # rank, world size, is_main
    device: torch.device             # where the model's parameters live
    backend: SingleDevice            # the step's pieces: train_step, backward, all_reduce_mean,
    #                                  optimizer_step, state dicts, barrier (sailfin.backends;
    #                                  every strategy is a SingleDevice)
    hparams: Optional[Mapping[str, Any]]  # the hyper-parameters the writers log (None: the settings)

    # -- counters (read; checkpointing/state.py restores them) --------------------------
    global_step: int                 # optimizer steps done
    epoch: int                       # the current epoch (0-based)
    step_in_epoch: int               # optimizer steps done in the current epoch
    samples_seen: int                # samples behind the optimizer steps done
    train_seconds: float             # time spent training (validation every N excluded)
    validation_seconds: float        # time spent validating (features/time_account.py)
    data_seconds: float              # time spent waiting for the train loader (next, iter)
    steps_per_epoch: int             # optimizer steps in a full epoch
    num_train_samples: int           # samples in one epoch of the training data
    last_val_step: int               # the global step last validated at (-1: none yet)
    last_val_metrics: dict[str, dict[str, float]]  # validation set name -> its metrics
    summary: Optional[dict[str, Any]]  # summary.json's fields, once train() has finished

    # -- the run's pieces ---------------------------------------------------------------
    plan: BatchPlan                  # the batch plan in effect
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[torch.optim.lr_scheduler.LRScheduler]
    trainable_params: list[torch.nn.Parameter]
    val_loaders: dict[str, Iterable[Any]]  # validation set name -> loader
    callbacks: list[Callback]        # every callback, in call order (their state is saved)
    writers: Writers                 # the metric writers
    heartbeat: Heartbeat             # where the loop is, for the hang watchdog (phase, step)
    resumed_from: Optional[Loaded]   # the checkpoint this run resumed from, or None

    # -- pieces the composition root built, for the features that work together ---------
    checkpointer: Checkpointer       # storage (sailfin.checkpoint)
    saver: Optional[Callback]        # the checkpoint callback, or None (checkpointing/saver.py)
    nonfinite: LossGuard             # the non-finite loss guard (safety/nonfinite.py)
    preemption: StopSignal           # the SIGTERM flag and agreement (safety/preemption.py)
    ema: Optional[Callback]          # the weight average, or None (features/ema.py)
    flops: StepFlops                 # the FLOPs meter (features/flops.py)
    autobatch: Optional[Callback]    # micro_batch_size: auto's search, or None (its retries:
    #                                  features/autobatch.py; the time account reads them)

    # -- a way to stop -------------------------------------------------------------------
    stop_reason: Optional[dict[str, Any]]  # set it (reason, step, ...): the run ends after this step

    # -- what a feature may call ---------------------------------------------------------
    def validate(self) -> dict[str, dict[str, float]]:
        """Run every validation set now; name -> metrics."""

    def exclude_time(self, seconds: float) -> None:
        """``seconds`` spent inside a hook on something else: not training time."""

    def replan(self, micro_batch_size: int) -> None:
        """Run with another micro-batch size from the current step (same global batch)."""

    def remove_callback(self, callback: Callback) -> None:
        """Stop calling ``callback`` from the next step on."""

    def state_dict(self) -> dict[str, Any]:
        """Every stateful piece but the random streams (what a checkpoint saves)."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put back what :meth:`state_dict` returned."""


# -- epochs as users read them ---------------------------------------------------------
# Counted from 1 on every line and in every log (the console, the progress bar,
# metrics.jsonl, metrics.csv, summary.json, the resume and error lines); the loop's own
# counter (RunView.epoch, a checkpoint's manifest) stays the 0-based index of the epoch
# under way, which with the seed fixes the data order.
def epoch_number(epoch: int, step_in_epoch: int) -> int:
    """The epoch, counted from 1, of the loop's position (``epoch``: the 0-based index,
    ``step_in_epoch``: steps done in it): the epoch a step inside it belongs to; at an
    epoch boundary, the epoch just finished (the first, before any step)."""
    return epoch + 1 if step_in_epoch > 0 else max(epoch, 1)


def epoch_position(epoch: int, step_in_epoch: int) -> str:
    """Where the loop stands, in words: ``'4 step(s) into epoch 2'``, ``'at the end of
    epoch 2'``, ``'at the start of epoch 1'``."""
    if step_in_epoch > 0:
        return f"{step_in_epoch} step(s) into epoch {epoch + 1}"
    return f"at the end of epoch {epoch}" if epoch > 0 else "at the start of epoch 1"
