"""Validation: run every validation set, collect outputs (one list, one concatenation,
dataset order), and log the recipe's metrics."""

from __future__ import annotations

import contextlib
import itertools
from typing import TYPE_CHECKING, Any, Iterable

import torch

from ...checkpoint.rng import seed_loader
from ...config.trainer import TrainerArguments
from ...distributed.watchdog import VALIDATION
from ..safety.startup_checks import zero_dim_message
from .train_log import scalar

if TYPE_CHECKING:
    from .trainer import Trainer


def run_validation(trainer: "Trainer") -> dict[str, dict[str, float]]:
    """Every validation set through ``val_step`` and ``on_end_val_epoch``: name -> metrics."""
    results: dict[str, dict[str, float]] = {}
    module, args = trainer.module, trainer.args
    was_training = module.training
    trainer.heartbeat.phase = VALIDATION
    module.eval()
    with torch.no_grad(), validation_weights(trainer):
        for name, loader in trainer.val_loaders.items():
            # Validating draws nothing from the training's random streams.
            seed_loader(loader, args.seed, trainer.global_step, trainer.dist.rank)
            local = merge_outputs(trainer.backend.validation_outputs(
                module, trainer.global_step,
                trainer.heartbeat.count(val_batches(loader, args))))
            outputs = trainer.backend.gather_outputs(local)
            metrics = module.on_end_val_epoch(trainer.global_step, outputs, name) or {}
            metrics = {k: scalar(v) for k, v in metrics.items()}
            results[name] = metrics
            if metrics:
                event = dict(metrics)
                if len(trainer.val_loaders) > 1:
                    event = {"dataset": name, **event}
                trainer.writers.log_metrics(event, trainer.global_step, trainer.epoch, "val")
    module.train(was_training)
    return results


def validation_weights(trainer: "Trainer") -> Any:
    """The EMA weights swapped in for validation when ``trainer.ema.validate`` says."""
    if trainer.ema is not None and trainer.args.ema.validate:
        return trainer.ema.swapped_in(trainer.module)
    return contextlib.nullcontext()


def merge_outputs(batches: list[Any], where: str = "val_step") -> dict[str, Any]:
    """Merge per-batch ``val_step`` dicts into one dict, concatenating once per key.

    Tensors are concatenated on their first dimension (a 0-d tensor is an error);
    lists are chained; any other value becomes a list with one entry per batch.
    """
    if not batches:
        return {}
    keys = None
    columns: dict[str, list[Any]] = {}
    for i, out in enumerate(batches):
        if not isinstance(out, dict):
            raise TypeError(f"{where} must return a dict of tensors (first dim = batch); "
                            f"batch {i} returned {type(out).__name__}")
        if keys is None:
            keys = list(out)
            columns = {k: [] for k in keys}
        elif list(out) != keys and set(out) != set(keys):
            raise ValueError(f"{where} returned keys {sorted(out)} for batch {i} but "
                             f"{sorted(keys)} before; return the same keys every batch")
        for k in keys:
            columns[k].append(out[k])
    return {k: _concat(v, k, where) for k, v in columns.items()}


def val_batches(loader: Iterable[Any], args: TrainerArguments) -> Iterable[Any]:
    """The loader's batches, at most ``max_val_steps_per_epoch`` of them (this rank's)."""
    limit = args.max_val_steps_per_epoch
    return loader if limit is None else itertools.islice(loader, limit)


def _concat(values: list[Any], key: str, where: str) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:  # a batch mean would change the metric with the batch size
            raise ValueError(zero_dim_message(where, key))
        return torch.cat(values)
    if isinstance(first, list):
        return [x for v in values for x in v]
    return list(values)
