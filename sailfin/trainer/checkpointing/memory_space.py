"""Whether memory snapshots fit: what a node's snapshot directory will hold, counted
before the first step from the state's real sizes.

Before the first optimizer step an optimizer holds no state, yet the snapshot of
step 1 holds all of it (Adam: two tensors the size of each parameter, and a
step count). So the optimizer's state is sized from its parameters: a twin of
the optimizer, on ``meta`` copies of this rank's parameters (the local shard
under fsdp), takes one step and its state is counted; no memory is used and the
real optimizer is not touched.

A node holds, per rank that writes to it: two snapshots (the newest complete
one and the one being written), times two with a replica from another node,
and the staging copy the writer process reads from (files in the same
directory). Replicated state (``ddp``) is written once per node, by its local
leader; the other ranks write their random state only.
"""

from __future__ import annotations

from typing import Any

import torch

_FILE_OVERHEAD = 1 << 16  # torch.save's archive around the tensors, per file (generous)


def state_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` (shared storages counted once; ``meta`` tensors by
    their size; a DTensor by its local shard)."""
    seen: dict[Any, int] = {}
    stack = [obj]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if hasattr(value, "to_local"):  # a DTensor (fsdp): this rank's rows
                value = value.to_local()
            if value.device.type == "meta":
                seen[id(value)] = value.numel() * value.element_size()
            else:
                storage = value.untyped_storage()
                seen[(storage.data_ptr(), str(value.device))] = storage.nbytes()
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return sum(seen.values())


def stepped_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes ``optimizer``'s state holds once it has stepped (what it holds now if it has;
    0 for an optimizer whose twin cannot step on ``meta`` tensors: the run checks again
    after each snapshot)."""
    inner = getattr(optimizer, "original_optimizer", optimizer)  # Opacus wraps the recipe's
    if inner.state:
        return state_bytes(dict(inner.state))
    groups = []
    for group in inner.param_groups:
        metas = []
        for param in group["params"]:
            local = param.to_local() if hasattr(param, "to_local") else param
            meta = torch.nn.Parameter(torch.empty(local.shape, dtype=local.dtype,
                                                  device="meta"),
                                      requires_grad=param.requires_grad)
            if param.requires_grad:
                meta.grad = torch.empty_like(meta)
            metas.append(meta)
        # No fused or capturable kernels for meta tensors: the state they keep is the same.
        plain = {k: False for k in ("fused", "capturable", "foreach") if k in group}
        groups.append({**group, **plain, "params": metas})
    twin = object.__new__(type(inner))
    try:
        torch.optim.Optimizer.__init__(twin, groups, dict(inner.defaults))
        with torch.no_grad():
            twin.step()
    except Exception:  # an optimizer that needs more than torch's contract: measured later
        return 0
    return state_bytes(dict(twin.state))


def snapshot_bytes(state: Any, rank_state: Any, optimizers: list[torch.optim.Optimizer],
                   writes_shared: bool) -> tuple[int, int]:
    """(bytes this rank writes per snapshot, bytes of the whole snapshot state): ``state``
    is the trainer's state as a snapshot holds it, its optimizers' state counted as after
    their first step."""
    grown = sum(max(0, stepped_state_bytes(opt)
                    - state_bytes(dict(getattr(opt, "original_optimizer", opt).state)))
                for opt in optimizers)
    shared = state_bytes(state) + grown + 2 * _FILE_OVERHEAD
    own = state_bytes(rank_state) + _FILE_OVERHEAD
    return (shared if writes_shared else 0) + own, shared + own


def mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
