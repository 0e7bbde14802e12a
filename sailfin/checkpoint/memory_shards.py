"""fsdp state in a memory snapshot: each rank keeps its own rows as plain tensors.

A memory snapshot is resumed on the same ranks that wrote it, so no resharding
is needed: a DTensor is kept as its local rows plus its global shape, stride
and placements, and rebuilt on the same device mesh on load.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

MARK = "__sailfin_dtensor__"


def local_shards(state: Any) -> Any:
    """``state`` with every DTensor replaced by a plain dict holding its local rows
    (``state`` itself when it holds none: sp and ddp)."""
    from torch.distributed.tensor import DTensor

    from .sharded import holds

    return _localize(state) if holds(state, DTensor) else state


def _localize(state: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return {MARK: state.to_local(), "shape": list(state.shape),
                "stride": list(state.stride()),
                "placements": [_placement(p) for p in state.placements]}
    if isinstance(state, dict):
        return {k: _localize(v) for k, v in state.items()}
    if type(state) in (list, tuple):
        return type(state)(_localize(v) for v in state)
    return state


def global_shards(state: Any, mesh: Optional[Any]) -> Any:
    """Undo :func:`local_shards` on ``mesh`` (the model's device mesh)."""
    return _globalize(state, mesh) if _has_mark(state) else state


def _has_mark(state: Any) -> bool:
    stack = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if MARK in item:
                return True
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return False


def _globalize(state: Any, mesh: Optional[Any]) -> Any:
    if isinstance(state, dict) and MARK in state:
        if mesh is None:
            raise ValueError("the memory snapshot holds fsdp shards but this run's model is "
                             "not sharded")
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(state[MARK].to(mesh.device_type), mesh,
                                  [_rebuild(p) for p in state["placements"]],
                                  run_check=False, shape=torch.Size(state["shape"]),
                                  stride=tuple(state["stride"]))
    if isinstance(state, dict):
        return {k: _globalize(v, mesh) for k, v in state.items()}
    if type(state) in (list, tuple):
        return type(state)(_globalize(v, mesh) for v in state)
    return state


def mesh_of(module: torch.nn.Module) -> Optional[Any]:
    """The device mesh of the module's sharded parameters, or None."""
    from torch.distributed.tensor import DTensor

    for param in module.parameters():
        if isinstance(param, DTensor):
            return param.device_mesh
    return None


def _placement(p: Any) -> list:
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(p, Shard):
        return ["shard", p.dim]
    if isinstance(p, Replicate):
        return ["replicate"]
    raise ValueError(f"memory snapshots cannot keep a DTensor placed as {p}")


def _rebuild(p: list) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    return Shard(int(p[1])) if p[0] == "shard" else Replicate()
