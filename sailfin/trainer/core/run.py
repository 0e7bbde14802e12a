"""The pieces a run is made of, each a typed field: what ``build_run``
(``compose/setup.py``) builds from the config and :meth:`Loop.attach
<sailfin.trainer.core.trainer.Loop.attach>` takes. The loop holds them as its own
attributes (a step reads ``self.plan``), so ``replan`` and the resume change the loop's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch

from ...checkpoint import Checkpointer, Loaded
from ...data.plan import BatchPlan
from ...data.sampler import ResumableSampler
from ...logging.writers import Writers
from .callbacks import Callback
from .view import LossGuard, StepFlops


@dataclass(eq=False, repr=False)
class Run:
    # -- the data and the batch plan -----------------------------------------------------
    plan: BatchPlan                  # the batch plan in effect (replan() changes it)
    device: torch.device             # where the model's parameters live
    train_loader: Iterable[Any]      # the recipe's training loader, batched by train_sampler
    train_sampler: ResumableSampler  # the step's micro-batches and the data position
    num_train_samples: int           # samples in one epoch of the training data
    steps_per_epoch: int             # optimizer steps in a full epoch
    val_loaders: dict[str, Iterable[Any]]  # validation set name -> loader
    # -- the optimization -----------------------------------------------------------------
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[torch.optim.lr_scheduler.LRScheduler]
    trainable_params: list[torch.nn.Parameter]  # what max_grad_norm clips
    nonfinite: LossGuard             # what a NaN/inf loss does (trainer.on_nonfinite)
    # -- the features, as callbacks in call order (compose/setup.py CALLBACK_ORDER) --------
    callbacks: list[Callback]
    checkpointer: Checkpointer       # storage
    saver: Optional[Callback]        # the checkpoint callback, or None
    run_stats: Callback              # the best validation value and its step
    ema: Optional[Callback]          # the weight average, or None
    flops: StepFlops                 # the FLOPs meter
    autobatch: Optional[Callback]    # micro_batch_size: auto's search, or None
    # -- the recipe's hooks, called with what their signatures take (None: not overridden) -
    end_backward_hook: Optional[Callable[[int, torch.Tensor], Any]]
    end_train_step_hook: Optional[Callable[..., Any]]  # memory snapshots' wait chained first
    end_val_epoch_hook: Callable[..., Any]
    dataset_epoch_hook: Optional[Callable[[int], Any]]  # the training dataset's set_epoch
    # -- what the resume sets (compose/setup.py start_run) ----------------------------------
    writers: Writers = field(default_factory=Writers)  # the metric writers (rank 0)
    resumed_from: Optional[Loaded] = None  # the checkpoint this run resumed from, or None
    # Resumed at its end (the same command again): what it finished at and the message
    # said; the run then trains, calls and writes nothing. None for a run that trains.
    finished: Optional[dict[str, Any]] = None
