"""What the loop looks up once per epoch (the callbacks behind each hook, the recipe's
overridden callbacks) and the one rare micro-batch kind (padding)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch

from ...interfaces import ModuleInterface
from .callbacks import Callback
from .pymarlin_forms import unpack

if TYPE_CHECKING:
    from .trainer import Loop


def padding_micro_batch(backend: Any, module: Any, global_step: int, batch: Any,
                        step_loss: Optional[torch.Tensor], stats: Optional[Mapping[str, Any]]
                        ) -> tuple[torch.Tensor, Optional[Mapping[str, Any]]]:
    """Run a weight-0 padding micro-batch (see :mod:`sailfin.data.plan`): this rank
    joins its partners' collectives and the gradient all-reduce, and adds nothing.
    ``module.padding_batch`` is True meanwhile, so a recipe can leave it out of its
    own counts. The step's stats stay those of its last real micro-batch; a rank
    with none takes the padding's, so every rank logs the same stat names."""
    module.padding_batch = True
    try:
        out = backend.train_step(module, global_step, batch, True)
    finally:
        module.padding_batch = False
    loss, pad_stats = unpack(out)
    loss = loss * 0.0
    backend.backward(loss)
    step_loss = loss if step_loss is None else step_loss.detach() + loss.detach()
    return step_loss, pad_stats if stats is None else stats


def overridden(module: ModuleInterface, name: str) -> Any:
    """The module's callback if the recipe overrides it, else None (skip the call)."""
    if getattr(type(module), name, None) is getattr(ModuleInterface, name):
        return None
    return getattr(module, name)


def overriding(callbacks: list[Callback], hook: str) -> list[Callback]:
    """The callbacks whose class overrides ``hook``: the others' calls are skipped."""
    return [c for c in callbacks if getattr(type(c), hook) is not getattr(Callback, hook)]


def any_says_again(callbacks: list[Callback], trainer: "Loop", micros: Any) -> bool:
    """``on_backward_end`` in order, until one asks for the step again."""
    samples = sum(m.count for m in micros)
    return any(c.on_backward_end(trainer, samples) for c in callbacks)


def as_list(value: Any, what: str) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def recipe_callbacks(module: Any) -> list[Callback]:
    """The recipe's own components (``configure_callbacks()``, e.g. sailfin.hf's final/hf/
    writer): they follow the loop like the callbacks given to the trainer."""
    hook = getattr(module, "configure_callbacks", None)
    return list(hook()) if callable(hook) else []
