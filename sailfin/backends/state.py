"""Optimizer state in its two layouts: ``optimizer.state_dict()`` keys each parameter's
state by its index in the optimizer, PyTorch's distributed state dicts
(``get_optimizer_state_dict``, what a checkpoint holds) by parameter name. A checkpoint
of one layout resumes under a backend of the other: index i is the i-th parameter of
the same recipe's optimizer.
"""

from __future__ import annotations

from typing import Any

import torch


def optimizer_state_is_named(state: dict[str, Any]) -> bool:
    """True for the by-name layout (distributed state dicts), False for ``state_dict()``'s."""
    groups = state.get("param_groups") or []
    return any(isinstance(p, str) for g in groups for p in g.get("params", ()))


def named_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                          state: dict[str, Any]) -> dict[str, Any]:
    """``optimizer.state_dict()``-layout ``state`` re-keyed by ``module``'s parameter names."""
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    saved_groups, groups = state["param_groups"], optimizer.param_groups
    if len(saved_groups) != len(groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, groups)):
        raise ValueError(
            f"the saved optimizer has parameter groups of sizes "
            f"{[len(g['params']) for g in saved_groups]}, this one "
            f"{[len(g['params']) for g in groups]}")
    index_to_name: dict[Any, str] = {}
    for saved, group in zip(saved_groups, groups):
        for index, param in zip(saved["params"], group["params"]):
            if id(param) not in names:
                raise ValueError("the optimizer holds a parameter the model does not own")
            index_to_name[index] = names[id(param)]
    return {"state": {index_to_name[i]: per for i, per in state["state"].items()},
            "param_groups": [{**g, "params": [index_to_name[i] for i in g["params"]]}
                             for g in saved_groups]}


def dcp_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (``optimizer``'s, in either layout) keyed as PyTorch's distributed state
    dicts key it, the layout a checkpoint holds on every backend.

    An optimizer that has not stepped is re-keyed as it is: reading it through
    ``get_optimizer_state_dict`` would step it once with zero gradients (Adam's step count
    becomes 1), and reading the state must never change the run.
    """
    if optimizer_state_is_named(state):
        return state
    if not optimizer.state:
        return named_optimizer_state(module, optimizer, state)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer)
