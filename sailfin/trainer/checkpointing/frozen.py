"""Checkpoints without the frozen base: ``ModuleInterface.checkpoint_frozen_params = False``.

A parameter-efficient fine-tune (LoRA through ``sailfin.hf``'s ``peft:``) trains a few
adapters on top of a base that never changes. Its checkpoints and memory snapshots
then hold only the parameters that train (plus buffers and the optimizers' state) and a
fingerprint of the frozen ones; a resume takes the frozen parameters from the module
as built, after checking the fingerprint, so resuming onto another base stops before
the first step.

The fingerprint is, per frozen parameter, its name, shape, dtype and the sum and sum
of squares of its values in float64 (under fsdp reduced over the ranks, so it is the
same on any world size), rounded to 10 significant digits.

Example::

    recipe.checkpoint_frozen_params = False
    names = frozen_names(recipe)            # {"bert.encoder.layer.0.attention.self.query.weight", ...}
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[frozenset, list]]" = (
    weakref.WeakKeyDictionary())


def excludes_frozen(module: torch.nn.Module) -> bool:
    """Whether ``module``'s checkpoints leave its frozen parameters out."""
    return not getattr(module, "checkpoint_frozen_params", True)


def frozen_names(module: torch.nn.Module) -> frozenset[str]:
    """The state-dict names of ``module``'s parameters that do not train."""
    return _described(module)[0]


def fingerprint(module: torch.nn.Module) -> list[list[Any]]:
    """What identifies the frozen base (computed once per module: it does not change)."""
    return _described(module)[1]


def _described(module: torch.nn.Module) -> tuple[frozenset, list]:
    cached = _CACHE.get(module)
    if cached is None:
        frozen = [(name, p) for name, p in module.named_parameters(remove_duplicate=False)
                  if not p.requires_grad]
        prints = [[name, list(p.shape), str(p.dtype).replace("torch.", ""),
                   _figure(p.detach().double().sum()),
                   _figure(p.detach().double().square().sum())] for name, p in frozen]
        cached = _CACHE[module] = (frozenset(n for n, _ in frozen), prints)
    return cached


def _figure(value: torch.Tensor) -> float:
    full = getattr(value, "full_tensor", None)  # a DTensor (fsdp): reduced over the ranks
    return float(f"{float(full() if full else value):.10g}")


def mismatch(saved: list, now: list) -> str:
    """Why ``saved`` (a checkpoint's fingerprint) is not ``now``'s; "" when they agree."""
    saved_by = {entry[0]: entry for entry in saved}
    now_by = {entry[0]: entry for entry in now}
    if set(saved_by) != set(now_by):
        extra = sorted(set(saved_by) ^ set(now_by))[:3]
        return (f"the frozen parameters differ by name ({len(saved_by)} saved, {len(now_by)} "
                f"now; e.g. {', '.join(extra)})")
    for name, entry in now_by.items():
        if saved_by[name] != entry:
            return (f"frozen parameter {name} differs (saved shape/dtype/sum "
                    f"{saved_by[name][1:]}, now {entry[1:]})")
    return ""
