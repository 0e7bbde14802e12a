"""The model side of DP-SGD: which layers Opacus can train privately, and its hooks."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from ..config.errors import ConfigError
from ..utils.voice import say


def import_opacus() -> Any:
    """Opacus, or an error naming the extra that installs it."""
    try:
        import opacus
    except ImportError:
        raise ConfigError("the *-dp backends train with Opacus, which is not installed: "
                          "pip install 'sailfin[dp]'") from None
    return opacus


def unsupported_layers(module: torch.nn.Module) -> list[str]:
    """``name (Type)`` of each layer Opacus cannot compute per-sample gradients for:
    Opacus's ``ModuleValidator`` findings, and trainable layers that hold buffers."""
    from opacus.utils.module_utils import trainable_modules
    from opacus.validators import ModuleValidator

    bad, flagged = [], set()
    for name, sub in module.named_modules():
        check = ModuleValidator.VALIDATORS.get(type(sub))
        if check is not None and check(sub):
            bad.append(f"{name or '<root>'} ({type(sub).__name__})")
            flagged.add(name)
    for name, sub in trainable_modules(module):  # GradSampleHooks' own (strict) check
        if name not in flagged and list(sub.buffers(recurse=False)):
            bad.append(f"{name or '<root>'} ({type(sub).__name__}, trainable with buffers)")
    return bad


def fix_in_place(module: torch.nn.Module) -> list[str]:
    """Opacus's ``ModuleValidator.fix`` without its copy: the recipe stays the object the
    trainer holds. Returns ``name: Old -> New`` for each replaced layer."""
    from opacus.utils.module_utils import trainable_modules
    from opacus.validators import ModuleValidator

    done = []
    for name in [n for n, _ in trainable_modules(module)]:
        sub = module.get_submodule(name)
        fixer = ModuleValidator.FIXERS.get(type(sub))
        if fixer is None or not name:
            continue
        new = fixer(sub)
        new.to(next(sub.parameters()).device)
        module.set_submodule(name, new)  # PyTorch's public way to swap a submodule
        done.append(f"{name}: {type(sub).__name__} -> {type(new).__name__}")
    return done


def check_model(module: torch.nn.Module, fix: bool, backend: str) -> None:
    """Refuse (or, with ``trainer.dp.fix_model``, fix) layers that mix samples."""
    bad = unsupported_layers(module)
    if bad and fix:
        for line in fix_in_place(module):
            say(f"trainer.dp.fix_model: replaced {line}")
        bad = unsupported_layers(module)
    if bad:
        from opacus.validators import ModuleValidator

        fixers = [] if fix else [name for name, sub in module.named_modules()
                                 if name and type(sub) in ModuleValidator.FIXERS]
        way_out = (", or set trainer.dp.fix_model: true to let Opacus's ModuleValidator.fix "
                   "replace " + ", ".join(fixers)) if fixers else ""
        raise ConfigError(
            f"trainer.backend {backend}: Opacus cannot compute per-sample gradients for "
            f"{', '.join(bad)}"
            + (": BatchNorm mixes the samples of a batch; use GroupNorm "
               "(torch.nn.GroupNorm) instead" if any("BatchNorm" in b for b in bad) else
               "; replace these layers with ones that treat each sample alone")
            + way_out)


def attach_hooks(module: torch.nn.Module, clipping: str, max_grad_norm: float,
                 sharded: bool = False) -> Any:
    """Opacus's per-sample gradient hooks on ``module`` (not a wrapper: the recipe's
    ``train_step`` calls its submodules, whose hooks fire). ``sharded``: the module is
    FSDP2-sharded (Opacus's ghost_fsdp hooks, ghost clipping only)."""
    from opacus.grad_sample import GradSampleHooks, GradSampleHooksFastGradientClippingFSDP
    from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (
        GradSampleHooksFastGradientClipping)

    if sharded:
        return GradSampleHooksFastGradientClippingFSDP(
            module, batch_first=True, loss_reduction="mean", strict=False,
            max_grad_norm=max_grad_norm)
    if clipping == "ghost":
        return GradSampleHooksFastGradientClipping(
            module, batch_first=True, loss_reduction="mean", strict=False,
            max_grad_norm=max_grad_norm, use_ghost_clipping=True)
    return GradSampleHooks(module, batch_first=True, loss_reduction="mean", strict=False)


@contextlib.contextmanager
def naming_inplace_outputs(module: torch.nn.Module, backend: str) -> Iterator[None]:
    """Around the run's first forward with Opacus's hooks: an in-place change of a hooked
    layer's output (torchvision's ``out += identity``, ``ReLU(inplace=True)``), which
    autograd refuses deep in the forward, becomes one line naming the module whose
    forward did it. Nothing has been stepped yet: the run stops before step 1 is taken."""
    running: list[str] = []  # the modules whose forward is running, outermost first

    def enter(name: str) -> Any:
        return lambda _module, _args: running.append(name)  # None: the input is left as it is

    def leave(name: str) -> Any:
        def hook(_module: Any, _args: Any, _out: Any) -> None:  # None: output untouched
            if running[-1:] == [name]:
                running.pop()
        return hook

    handles = []
    for name, sub in module.named_modules():
        handles.append(sub.register_forward_pre_hook(enter(name)))
        handles.append(sub.register_forward_hook(leave(name)))
    try:
        yield
    except RuntimeError as err:
        text = str(err)
        if "BackwardHookFunction" not in text or "inplace" not in text:
            raise
        where = running[-1] if running else ""
        kind = type(module.get_submodule(where)).__name__
        raise ConfigError(
            f"trainer.backend {backend}: {where or '<root>'} ({kind}) changes a layer's output "
            "in place (such as out += identity or ReLU(inplace=True)), which Opacus's "
            "per-sample gradient hooks cannot follow (trainer.dp.fix_model replaces layers, "
            "not code); write it out of place (out = out + identity, inplace=False)"
        ) from None
    finally:
        for handle in handles:
            handle.remove()
