"""Files a finished run leaves behind: summary.json and final/model.safetensors."""

from __future__ import annotations

import json
import os
from typing import Any

import torch


def write_json_atomic(path: str, data: Any) -> None:
    """Write JSON to a temporary file and rename it: a reader never sees half a file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, default=_jsonable)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return str(value)


def save_final_weights(state: dict[str, torch.Tensor], output_dir: str) -> str:
    """``<output_dir>/final/model.safetensors``, written to a temporary name first.

    ``state`` is the model's full state dict (plain parameter names, whatever
    backend trained it). Tied weights are stored once, under their first name.
    """
    return save_weights(state, os.path.join(output_dir, "final", "model.safetensors"))


def save_weights(state: dict[str, torch.Tensor], path: str) -> str:
    """A full state dict as safetensors at ``path``, written to a temporary name first."""
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file(_untied(state), tmp, metadata={"format": "pt"})
    os.replace(tmp, path)
    return path


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor once (safetensors refuses tensors that share memory), contiguous."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out = {}
    for name, tensor in state.items():
        tensor = tensor.detach()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = tensor.contiguous()
    return out
