"""Final weights of a sharded model, saved without any rank holding the whole model.

Every rank walks the module's state dict in the same order (the file's), gathers one
tensor (``full_tensor``: an all-gather), and drops it before the next; the writing rank
appends its bytes to the file first. A rank holds its own shards plus about one full
tensor at a time. The header is known before any data (a DTensor has the global shape
and dtype), so the file is written front to back, once.

Example (every rank calls it)::

    save_streamed(module, "out/final/model.safetensors", write=dist.is_main)
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from ..checkpoint.weights_file import SafetensorsWriter, TensorSpec, file_order
from ..utils.memory import release_free_memory


@torch.no_grad()
def save_streamed(module: torch.nn.Module, path: str, write: bool) -> Optional[str]:
    """``module``'s weights (DTensor shards gathered one at a time, plain tensors as they
    are) as safetensors at ``path``, under ``module.state_dict()``'s names, tied weights
    once. Every rank calls it; the rank with ``write`` writes and gets the path.

    A write that fails (a full disk) does not stop the gathers, so the other ranks never
    wait on a rank that left; the error is raised once every tensor went by.
    """
    state = distinct(module.state_dict(keep_vars=True))  # the same on every rank
    order = file_order([TensorSpec.of(name, value) for name, value in state.items()])
    writer: Optional[SafetensorsWriter] = None
    error: Optional[BaseException] = None
    if write:
        try:
            writer = SafetensorsWriter(path, order)
        except Exception as exc:  # noqa: BLE001 - raised once the gathers are done
            error = exc
    try:
        for spec in order:
            full = _full(state[spec.name])
            if writer is not None and error is None:
                try:
                    writer.write(spec.name, full)
                except Exception as exc:  # noqa: BLE001 - raised once the gathers are done
                    error = exc
                    writer.abort()
            del full  # before the next gather: one full tensor at a time
            release_free_memory()  # gloo's freed buffers, or each gather would add its size
    except BaseException:  # a collective failed: no half-written file stays behind
        if writer is not None:
            writer.abort()
        raise
    if error is not None:
        raise error
    return writer.commit() if writer is not None else None


def distinct(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor once, under its first name. Tied sharded parameters are one object;
    plain tensors that share memory are tied as safetensors sees them. The choice never
    depends on a rank's shard (an empty one included), so every rank skips the same."""
    seen: set[tuple] = set()
    out = {}
    for name, value in state.items():
        if isinstance(value, DTensor):
            key: Optional[tuple] = ("dtensor", id(value))
        elif value.numel():
            key = (value.untyped_storage().data_ptr(), value.storage_offset(),
                   tuple(value.shape))
        else:
            key = None
        if key is not None and key in seen:
            continue
        seen.add(key)
        out[name] = value
    return out


def _full(value: torch.Tensor) -> torch.Tensor:
    if not isinstance(value, DTensor):
        return value.detach()  # a buffer, the same on every rank
    if value.device.type != value.device_mesh.device_type:
        # cpu_offload: shards in CPU memory, the collective runs on the accelerator.
        value = value.to(value.device_mesh.device_type)
    return value.full_tensor()
