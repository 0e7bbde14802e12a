"""Collecting validation outputs: one list, one concatenation, dataset order."""

from __future__ import annotations

import itertools
from typing import Any, Iterable

import torch

from ...config.trainer import TrainerArguments
from ..safety.startup_checks import zero_dim_message


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
