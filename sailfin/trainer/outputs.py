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


def save_final_weights(module: torch.nn.Module, output_dir: str) -> str:
    """``<output_dir>/final/model.safetensors``, written to a temporary name first."""
    return save_weights(module, os.path.join(output_dir, "final", "model.safetensors"))


def save_weights(module: torch.nn.Module, path: str) -> str:
    """``module``'s weights as safetensors at ``path``, written to a temporary name first."""
    from safetensors.torch import save_model

    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    save_model(module, tmp)  # handles tied (shared) weights
    os.replace(tmp, path)
    return path
