"""Activation (gradient) checkpointing by submodule class name (docs/backends.md), with
the non-reentrant ``torch.utils.checkpoint``: it supports keyword arguments, inputs that
do not require grad and ``torch.compile``, and replays the RNG so that dropout masks match.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from ..config.errors import ConfigError, suggest


def apply_activation_checkpointing(module: torch.nn.Module, class_names: Sequence[str]
                                   ) -> list[str]:
    """Checkpoint every submodule whose class is named in ``class_names``.

    Returns the dotted names of the checkpointed submodules. A submodule inside
    one already checkpointed is left alone (its activations are not stored
    anyway). Parameter names and ``state_dict`` keys do not change: only the
    instance's ``forward`` is replaced.

    Example::

        apply_activation_checkpointing(gpt, ["Block"])   # ['blocks.0', 'blocks.1', ...]
    """
    present = sorted({type(m).__name__ for _, m in module.named_modules() if m is not module})
    for i, name in enumerate(class_names):
        if name not in present:
            raise ConfigError(
                f"trainer.activation_checkpointing[{i}] is '{name}'{suggest(name, present)}, "
                f"but {type(module).__name__} has no submodule of that class; classes present: "
                f"{', '.join(present) or '(none)'}")
    wanted = set(class_names)
    done: list[str] = []
    for path, sub in module.named_modules():
        if (sub is module or type(sub).__name__ not in wanted
                or any(path.startswith(parent + ".") for parent in done)):
            continue
        if not getattr(sub.forward, "_sailfin_checkpointed", False):  # set-up ran before
            sub.forward = _checkpointed(sub.forward)
        done.append(path)
    return done


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # validation: nothing is stored for backward anyway
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    run._sailfin_checkpointed = True  # type: ignore[attr-defined]
    return run
