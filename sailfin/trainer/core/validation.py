"""Validation: run every validation set, collect outputs (one list, one concatenation,
dataset order), and log the recipe's metrics."""

from __future__ import annotations

import contextlib
import itertools
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch

from ...checkpoint.rng import seed_loader
from ...config.trainer import TrainerArguments
from ...distributed.watchdog import VALIDATION, VALIDATION_GATHER
from .view import epoch_number
from .pymarlin_forms import batch_size
from .train_log import scalar

if TYPE_CHECKING:
    from .trainer import Loop


def run_validation(trainer: "Loop", log: bool = True) -> dict[str, dict[str, float]]:
    """Every validation set through ``val_step`` and ``on_end_val_epoch``: name -> metrics
    (logged to the writers unless not ``log``)."""
    results: dict[str, dict[str, float]] = {}
    module, args = trainer.module, trainer.args
    was_training = module.training
    trainer.heartbeat.phase = VALIDATION
    # Every rank validates with the buffers (BatchNorm statistics) that are saved: rank 0's.
    trainer.backend.sync_buffers(module)
    module.eval()
    # The EMA weights swapped in for validation when trainer.ema.validate says.
    swapped = (trainer.ema.swapped_in(module) if trainer.ema is not None and args.ema.validate
               else contextlib.nullcontext())
    with torch.no_grad(), swapped:
        for name, loader in trainer.val_loaders.items():
            # Validating draws nothing from the training's random streams.
            seed_loader(loader, args.seed, trainer.global_step, trainer.dist.rank)
            sizes: list[int] = []  # samples per batch: a 0-d output counts once per sample
            local = merge_outputs(trainer.backend.validation_outputs(
                module, trainer.global_step,
                trainer.heartbeat.count(_counted(loader, args, sizes))), sizes=sizes)
            trainer.heartbeat.phase = VALIDATION_GATHER  # done here: a slower rank is behind
            outputs = trainer.backend.gather_outputs(local)
            trainer.heartbeat.phase = VALIDATION
            metrics = trainer.end_val_epoch_hook(trainer.global_step, outputs, name) or {}
            results[name] = metrics = {k: scalar(v) for k, v in metrics.items()}
            if metrics and log:
                event = ({"dataset": name, **metrics} if len(trainer.val_loaders) > 1
                         else dict(metrics))
                trainer.writers.log_metrics(event, trainer.global_step, epoch_number(
                    trainer.epoch, trainer.step_in_epoch), "val")
    module.train(was_training)
    return results


def due_after_epoch(args: TrainerArguments, epoch: int) -> bool:
    """``val_every_n_epochs`` asks for validation after ``epoch`` (and after the last)."""
    every = args.val_every_n_epochs
    return bool(every) and ((epoch + 1) % every == 0 or epoch + 1 == args.epochs)


def merge_outputs(batches: list[Any], sizes: list[int]) -> dict[str, Any]:
    """Merge per-batch ``val_step`` dicts into one dict, concatenating once per key.

    Tensors are concatenated on their first dimension; a 0-d tensor is the batch's mean
    and counts once per sample of its batch (``sizes[i]``, else the length of another
    output), so a column's mean is the exact per-sample mean. Lists are chained; any
    other value becomes a list with one entry per batch. A tuple return (PyMarlin's
    form) becomes columns "0", "1", ... (see :mod:`.pymarlin_forms`)."""
    columns: dict[str, list[Any]] = {}
    for i, out in enumerate(batches):
        if isinstance(out, (tuple, list)):  # PyMarlin's tuple: columns "0", "1", ...
            out = {str(j): v for j, v in enumerate(out)}
        if not isinstance(out, dict):
            raise TypeError(f"val_step must return a dict of tensors (first dim = batch); "
                            f"batch {i} returned {type(out).__name__}")
        zero_d = [k for k, v in out.items() if isinstance(v, torch.Tensor) and v.dim() == 0]
        if zero_d:  # a batch mean: one entry per sample of its batch (an exact mean)
            count = sizes[i] if i < len(sizes) else batch_size(None, out)
            out = {k: v.reshape(1).expand(count) if k in zero_d else v for k, v in out.items()}
        if not i:
            columns = {k: [] for k in out}
        elif set(out) != set(columns):
            raise ValueError(f"val_step returned keys {sorted(out)} for batch {i} but "
                             f"{sorted(columns)} before; return the same keys every batch")
        for k, column in columns.items():
            column.append(out[k])
    return {k: _concat(v) for k, v in columns.items()}


def _counted(loader: Iterable[Any], args: TrainerArguments, sizes: list[int]
             ) -> Iterator[Any]:
    """The loader's batches, at most ``max_val_steps_per_epoch`` of them (this rank's);
    each batch's sample count is appended to ``sizes`` (a 0-d output's weight)."""
    limit = args.max_val_steps_per_epoch
    for batch in loader if limit is None else itertools.islice(loader, limit):
        sizes.append(batch_size(batch))
        yield batch


def _concat(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(values)
    if isinstance(first, list):
        return [x for v in values for x in v]
    return list(values)
