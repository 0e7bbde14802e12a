"""FSDP units from the model itself: its ``_no_split_modules`` classes, or its repeated blocks."""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch

from .errors import HFConfigError


def block_classes(model: torch.nn.Module) -> list[str]:
    """The class names a model's FSDP units should be: ``model._no_split_modules`` where
    the model declares them, else the class of the most repeated entry of its
    ``nn.ModuleList``s (BERT's ``BertLayer``).

    Example::

        block_classes(GPT2LMHeadModel(cfg))   # ['GPT2Block']
    """
    declared = [name for name in (getattr(model, "_no_split_modules", None) or [])
                if any(type(m).__name__ == name for m in model.modules())]
    if declared:
        return declared
    counts: Counter = Counter()
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            counts.update(type(m).__name__ for m in module)
    return [counts.most_common(1)[0][0]] if counts else []


def shard_blocks(model: torch.nn.Module, classes: list[str],
                 shard: Callable[[torch.nn.Module], torch.nn.Module]) -> list[str]:
    """``shard`` every submodule of a class in ``classes``, innermost first; returns their
    dotted names."""
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
