"""Collectives the trainer needs: a mean, and gathering validation outputs in order."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist


def all_reduce_mean(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """The mean of ``tensor`` over ranks (a new tensor; the input is untouched)."""
    out = tensor.detach().clone()
    dist.all_reduce(out)
    return out / world_size


def gather_outputs(local: dict[str, Any], rank: int, world_size: int,
                   device: Optional[torch.device] = None) -> dict[str, Any]:
    """Every rank's merged validation outputs, concatenated in rank order.

    Each rank validates a contiguous share of the dataset (rank r's share comes
    before rank r+1's), so rank order is dataset order. Tensors are gathered
    with one all-gather per key (padded to the longest share, trimmed after);
    lists and other values go through ``all_gather_object``. A rank with an
    empty share contributes nothing. Every rank gets the same result.
    """
    descriptions: list[Any] = [None] * world_size
    dist.all_gather_object(descriptions, _describe(local))
    keys = _agreed_keys(descriptions)
    comm_device = device if device is not None else torch.device("cpu")
    out: dict[str, Any] = {}
    for key in keys:
        kinds = {d[key][0] for d in descriptions if d}
        if kinds == {"tensor"}:
            out[key] = _gather_tensor(local.get(key), key, descriptions, rank, comm_device)
        else:
            parts: list[Any] = [None] * world_size
            value = local.get(key, [])
            dist.all_gather_object(parts, value.cpu() if isinstance(value, torch.Tensor)
                                   else value)
            out[key] = _chain(parts)
    return out


def _describe(local: dict[str, Any]) -> dict[str, tuple]:
    desc = {}
    for key, value in local.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            desc[key] = ("tensor", tuple(value.shape), str(value.dtype).replace("torch.", ""))
        else:
            desc[key] = ("object", type(value).__name__)
    return desc


def _agreed_keys(descriptions: list[Any]) -> list[str]:
    keys: Optional[list[str]] = None
    first_rank = -1
    for r, d in enumerate(descriptions):
        if not d:
            continue  # an empty share
        if keys is None:
            keys, first_rank = list(d), r
        elif set(d) != set(keys):
            raise ValueError(
                f"val_step returned keys {sorted(d)} on rank {r} but {sorted(keys)} on rank "
                f"{first_rank}; return the same keys on every rank and batch")
    return keys or []


def _gather_tensor(value: Optional[torch.Tensor], key: str, descriptions: list[Any],
                   rank: int, device: torch.device) -> torch.Tensor:
    shapes = [d[key][1] if d else None for d in descriptions]
    dtypes = {d[key][2] for d in descriptions if d}
    trailing = {s[1:] for s in shapes if s is not None}
    if len(dtypes) > 1 or len(trailing) > 1:
        raise ValueError(
            f"val_step output '{key}' has different dtypes or trailing shapes across ranks "
            f"({sorted(dtypes)}, {sorted(trailing)}); return the same shape after the batch "
            "dimension on every rank")
    dtype = getattr(torch, dtypes.pop())
    tail = trailing.pop()
    lengths = [s[0] if s is not None else 0 for s in shapes]
    longest = max(lengths)
    # Gloo has no bool all-gather: move bools as bytes.
    wire = torch.uint8 if dtype is torch.bool else dtype
    padded = torch.zeros((longest, *tail), dtype=wire, device=device)
    if value is not None and lengths[rank]:
        padded[:lengths[rank]] = value.detach().to(device=device, dtype=wire)
    parts = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(parts, padded)
    result = torch.cat([p[:n] for p, n in zip(parts, lengths)])
    return result.to(dtype) if wire is not dtype else result


def _chain(parts: list[Any]) -> Any:
    values = [p for p in parts if p is not None]
    if values and all(isinstance(p, torch.Tensor) for p in values):
        return torch.cat([p.reshape(-1) if p.dim() == 0 else p for p in values])
    chained: list[Any] = []
    for p in values:
        chained.extend(p if isinstance(p, list) else [p])
    return chained
