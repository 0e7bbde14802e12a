"""Checks that fail a run at its start rather than after an epoch: the schedulers' length,
a few validation batches (drawing nothing from the training's random streams) and the
first ``train_step``'s return (all called by Trainer.train before the first step)."""

from __future__ import annotations

import copy
import itertools
import random
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

import numpy as np
import torch

from ...distributed.watchdog import STARTUP_CHECKS, STARTUP_CHECKS_GATHER
from ...interfaces import RecipeError
from ..core.view import epoch_number, epoch_position
from ..core.pymarlin_forms import CallbackSignatureError, batch_size, val_epoch_end_caller
from ...utils.voice import say
from ..core.validation import merge_outputs

if TYPE_CHECKING:
    from ..core.view import RunView

TRAIN_STEP_FORMS = ("the batch's mean loss (a tensor with one value), "
                    "(loss, {name: scalar tensor}) to log more values, or PyMarlin's "
                    "(loss, outputs...) passed to on_end_train_step")


class StartupCheckError(RecipeError):
    """A recipe piece returned something the trainer cannot use; found before training."""


# -- schedulers ---------------------------------------------------------------------
def steps_left(trainer: "RunView") -> int:
    """Optimizer steps this run still takes (the rest of the epochs, capped by max_steps)."""
    args = trainer.args
    left = max(0, trainer.steps_per_epoch - trainer.step_in_epoch) if \
        trainer.epoch < args.epochs else 0
    left += max(0, args.epochs - trainer.epoch - 1) * trainer.steps_per_epoch
    if args.max_steps is not None:
        left = min(left, max(0, args.max_steps - trainer.global_step))
    return left


def nothing_to_train(trainer: "RunView") -> Optional[dict[str, Any]]:
    """When the run resumed at the end its config asks for (the same command again, or
    fewer epochs): what it finished at and the message saying so (rank 0 prints it); the
    run then trains and writes nothing, and ``sailfin train`` exits 3. None otherwise,
    also for a restart of a finished job (torchrun ``--max-restarts``): the job is done."""
    if steps_left(trainer) or trainer.resumed_from is None:
        return None
    args = trainer.args
    if trainer.dist.restart_count:
        if trainer.dist.is_main:
            say(f"resume: the run in {args.output_dir} had finished at step "
                f"{trainer.global_step} before this restart; nothing left to train")
        return None
    limits = f"trainer.epochs {args.epochs}" + (
        f", trainer.max_steps {args.max_steps}" if args.max_steps is not None else "")
    # The limits the run reached: raising only those continues it.
    reached = [key for key, at_end in (
        ("trainer.epochs", trainer.epoch >= args.epochs),
        ("trainer.max_steps", args.max_steps is not None
         and trainer.global_step >= args.max_steps)) if at_end] or ["trainer.epochs"]
    message = (
        f"nothing trained: the run in {args.output_dir} finished at step "
        f"{trainer.global_step} ({epoch_position(trainer.epoch, trainer.step_in_epoch)}; "
        f"{limits}). To train, use a new "
        f"trainer.output_dir (e.g. --trainer.output_dir {args.output_dir}-2) for a new run, "
        f"or raise {' and '.join(reached)} to continue this one")
    if trainer.dist.is_main:
        say(message)
    return {"output_dir": str(args.output_dir), "step": trainer.global_step,
            "epoch": epoch_number(trainer.epoch, trainer.step_in_epoch), "message": message}


def check_schedulers_fit(trainer: "RunView") -> None:
    """Stop now if a scheduler with a fixed length would run out during this run."""
    left = steps_left(trainer)
    for i, scheduler in enumerate(trainer.schedulers):
        total = getattr(scheduler, "total_steps", None)
        done = getattr(scheduler, "last_epoch", None)
        if not isinstance(total, int) or not isinstance(done, int) or done + left <= total:
            continue
        name = type(scheduler).__name__
        resumed = trainer.resumed_from is not None
        where = trainer.resumed_from.location if resumed else None  # type: ignore[union-attr]
        raise StartupCheckError(
            f"scheduler {i} ({name}) was built for total_steps={total} and has taken {done}; "
            f"this run takes {left} more optimizer step(s) (trainer.epochs "
            f"{trainer.args.epochs}, trainer.max_steps {trainer.args.max_steps}), "
            f"{done + left - total} past its end, where {name} cannot go. "
            + (f"The checkpoint's schedule cannot be extended: keep trainer.epochs / "
               f"max_steps as they were, or start a new run with a new schedule from its "
               f"weights: --trainer.init_from {where} --trainer.output_dir NEW_DIR"
               if resumed else
               "Build it with total_steps = estimated_global_steps_per_epoch * epochs "
               "(the arguments of get_optimizers_schedulers), or cap trainer.max_steps"))


# -- validation sanity check -----------------------------------------------------------
def sanity_validate(trainer: "RunView") -> None:
    """Run ``sanity_val_batches`` batches of each validation set through ``val_step``, and
    check that the recipe's ``on_end_val_epoch`` takes their gathered outputs (calling it
    only when the recipe sets ``sanity_check_on_end_val_epoch``)."""
    count = trainer.args.sanity_val_batches
    if not count or not trainer.val_loaders:
        return
    trainer.heartbeat.phase = STARTUP_CHECKS  # watched: a rank may stop in these batches
    module, device = trainer.module, trainer.device
    was_training = module.training
    states = (random.getstate(), np.random.get_state())
    devices = [device.index or 0] if device.type == "cuda" else []
    # fork_rng puts torch's streams back (iter(loader) draws its worker seed from them).
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        module.eval()
        module.sanity_checking = True
        try:
            for name, loader in trainer.val_loaders.items():
                where = (f"validation set {name!r}, sanity check before training; "
                         f"trainer.sanity_val_batches {count}")
                outputs, sizes = [], []
                for batch in itertools.islice(trainer.heartbeat.count(loader), count):
                    sizes.append(batch_size(batch))
                    out = trainer.backend.val_step(module, trainer.global_step, batch)
                    if not isinstance(out, (Mapping, tuple, list)):  # see pymarlin_forms
                        raise StartupCheckError(
                            f"val_step ({where}) returned {type(out).__name__}; it must "
                            "return a dict of per-sample values, e.g. {'pred': "
                            "logits.argmax(1), 'label': y} (first dimension = batch), or "
                            "PyMarlin's tuple (loss, logits, labels)")
                    outputs.append(out)
                merged = merge_outputs(outputs, sizes=sizes)
                trainer.heartbeat.phase = STARTUP_CHECKS_GATHER  # a slower rank is behind
                gathered = trainer.backend.gather_outputs(merged)
                trainer.heartbeat.phase = STARTUP_CHECKS
                # The callback's signature is checked; it is called only when the recipe
                # asks (its side effects could not be put back), and then the recipe's
                # checkpointed state (a count, a best score) is put back after it.
                calls = bool(getattr(module, "sanity_check_on_end_val_epoch", False))
                state = copy.deepcopy(module.get_state()) if calls else None
                try:
                    val_epoch_end_caller(module, check_only=not calls)(
                        trainer.global_step, gathered, name)
                except CallbackSignatureError as err:
                    raise StartupCheckError(f"{err} ({where})") from None
                if calls:
                    module.update_state(state)
        finally:
            module.sanity_checking = False
            module.train(was_training)
            random.setstate(states[0])
            np.random.set_state(states[1])


# -- the first train_step ------------------------------------------------------------------
def train_output_checker(step: int) -> Callable[[Any], None]:
    """A check of ``train_step``'s return; the loop calls it on the run's first micro-batch."""

    def check(out: Any) -> None:
        where = f"train_step (step {step + 1}, the run's first)"
        if type(out) is tuple:
            if not out:
                raise StartupCheckError(f"{where} returned an empty tuple; it must return "
                                        f"{TRAIN_STEP_FORMS}")
            loss = out[0]  # (loss, stats) or PyMarlin's (loss, outputs...): pymarlin_forms
        else:
            loss = out
        if not isinstance(loss, torch.Tensor):
            raise StartupCheckError(f"{where} returned {type(loss).__name__} as the loss; it "
                                    f"must return {TRAIN_STEP_FORMS}")
        if loss.numel() != 1:
            raise StartupCheckError(
                f"{where} returned a loss of shape {list(loss.shape)}; return the batch's "
                "MEAN loss (one value, e.g. loss.mean()): sailfin weights each micro-batch "
                "by its share of the step itself")
        if not loss.requires_grad:
            raise StartupCheckError(
                f"{where} returned a loss that does not require grad: it was computed under "
                "torch.no_grad(), from detached tensors, or the model has no trainable "
                "parameters")

    return check

