"""Which submodules the fsdp backends shard as units of their own (docs/sharding.md).

The default is the model's repeated blocks: a Hugging Face model's
``_no_split_modules``, otherwise the class of the children of its largest ``ModuleList``
or ``Sequential``. A unit needs a ``forward`` of its own (FSDP2 gathers in its forward
hooks, so a ``ModuleList`` can never gather), and tied parameters stay together, in one
unit or in the root.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Optional

from torch import nn

from ..compat.transformers import no_split_modules
from ..config.errors import ConfigError, suggest
from ..utils.voice import say


def has_forward(module: nn.Module) -> bool:
    """False for a container that only holds modules (``ModuleList``, ``ModuleDict``)."""
    return type(module).forward is not nn.Module.forward


def default_unit_classes(model: nn.Module) -> list[str]:
    """The class names of ``model``'s repeated blocks (see the module docstring).

    Example::

        default_unit_classes(GPT2LMHeadModel(cfg))   # ['GPT2Block']
        default_unit_classes(char_lm)                # ['Block']: children of its ModuleList
    """
    present = {type(m).__name__ for m in model.modules()}
    declared = list(dict.fromkeys(name for module in model.modules()  # in order, once
                                  for name in no_split_modules(module) if name in present))
    if declared:
        return declared
    lists = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential))]
    best = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)
    if best is None:
        return []
    counts = Counter(type(child).__name__ for child in best.children()
                     if has_forward(child) and any(True for _ in child.parameters()))
    return [name for name, _ in counts.most_common()]


def parameter_owners(model: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> the dotted names of every module that registers it."""
    owners: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(path)
    return owners


def tied_outside(path: str, module: nn.Module, owners: dict[int, list[str]]
                 ) -> Optional[tuple[str, str]]:
    """(a parameter of the unit at ``path``, a module outside it that holds it too), or None."""
    inside = path + "." if path else ""
    for name, param in module.named_parameters():
        for owner in owners.get(id(param), []):
            if owner != path and not owner.startswith(inside):
                return f"{path}.{name}" if path else name, owner
    return None


def select_units(module: nn.Module, names: Optional[list[str]]
                 ) -> list[tuple[str, nn.Module]]:
    """The submodules to shard as units, innermost first (FSDP2 shards nested units
    inside out).

    ``names`` holds class names or dotted module paths (``trainer.fsdp.units``); None:
    the default (see the module docstring), without the blocks that would split a tie.
    Example::

        select_units(gpt, ["Block"])     # [("blocks.0", ...), ("blocks.1", ...), ...]
    """
    modules = dict(module.named_modules())
    del modules[""]
    owners = parameter_owners(module)
    chosen: dict[str, nn.Module] = {}
    if names is None:
        wanted = set(default_unit_classes(module))
        for path, sub in modules.items():
            if type(sub).__name__ not in wanted or not has_forward(sub):
                continue
            tie = tied_outside(path, sub, owners)
            if tie is not None:  # left to the root, with the other side of the tie
                say(f"fsdp: {path} stays in the root: its {tie[0]} is tied to {tie[1]}")
                continue
            chosen[path] = sub
    else:
        classes = sorted({type(m).__name__ for m in modules.values()})
        for i, name in enumerate(names):
            if name in modules:
                matches = {name: modules[name]}
            else:
                matches = {path: m for path, m in modules.items() if type(m).__name__ == name}
            if not matches:
                raise ConfigError(
                    f"trainer.fsdp.units[{i}] is '{name}'"
                    f"{suggest(name, classes + list(modules))}, but {type(module).__name__} "
                    f"has no submodule of that class or path; classes present: "
                    f"{', '.join(classes) or '(none)'}")
            for path, sub in matches.items():
                check_unit(path, sub, owners, f"trainer.fsdp.units[{i}] ('{name}')")
            chosen.update(matches)
    from torch.distributed.fsdp import FSDPModule  # half a second: only when sharding

    return sorted(((n, m) for n, m in chosen.items() if not isinstance(m, FSDPModule)),
                  key=lambda item: -item[0].count("."))


def check_unit(path: str, sub: nn.Module, owners: dict[int, list[str]], where: str) -> None:
    """One line naming a unit FSDP cannot use, and what to set instead."""
    if not has_forward(sub):
        inner = sorted({type(c).__name__ for c in sub.children()})
        raise ConfigError(
            f"{where} takes {path or 'the model'}, a {type(sub).__name__} without forward: "
            "FSDP gathers a unit's parameters in its forward, so a container cannot be one; "
            f"name the class of its children instead ({', '.join(inner) or 'none'})")
    tie = tied_outside(path, sub, owners)
    if tie is not None:
        raise ConfigError(
            f"{where} takes {path}, whose parameter {tie[0]} is tied to {tie[1]} outside it: "
            "tied parameters must stay in one unit; leave it out (the root keeps it) or "
            "name a module that holds both")


def checked(model: nn.Module, where: str, shard: Callable[[nn.Module], nn.Module]
            ) -> Callable[[nn.Module], nn.Module]:
    """``shard`` for ``configure_sharding``: a unit FSDP cannot use (a container, a tie
    split) is first one line naming it, checked against the model before sharding."""
    owners = parameter_owners(model)
    paths = {id(m): p for p, m in model.named_modules()}

    def shard_checked(sub: nn.Module) -> nn.Module:
        check_unit(paths.get(id(sub), type(sub).__name__), sub, owners, where)
        return shard(sub)
    return shard_checked
