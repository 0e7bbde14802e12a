"""FSDP units from the model itself: its ``_no_split_modules`` classes, or its repeated blocks."""

from __future__ import annotations

from typing import Callable

import torch

from ..backends.fsdp_units import select_units
from .errors import HFConfigError


def shard_blocks(model: torch.nn.Module, classes: list[str] | None,
                 shard: Callable[[torch.nn.Module], torch.nn.Module]) -> list[str]:
    """``shard`` every submodule of a class in ``classes`` (None: the model's blocks, less
    those holding one side of a tie), innermost first; returns their dotted names."""
    if classes is None:
        chosen = select_units(model, None)
    else:
        present = {type(m).__name__ for m in model.modules()}
        for i, name in enumerate(classes):
            if name not in present:
                raise HFConfigError(f"module.init_args.fsdp_units[{i}] is '{name}', but "
                                    f"{type(model).__name__} has no submodule of that class")
        wanted = set(classes)
        chosen = [(name, m) for name, m in model.named_modules()
                  if m is not model and type(m).__name__ in wanted]
        chosen.sort(key=lambda item: -item[0].count("."))  # children before their parents
    for _, module in chosen:
        shard(module)
    return [name for name, _ in chosen]
