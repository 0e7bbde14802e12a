"""How the fsdp backends give a sharded model its starting weights: by contract, not by
recording what its constructor did (``trainer.fsdp.build``; docs/sharding.md tells both
builds step by step). ``rank0``, the default: rank 0 builds the recipe as ``sp`` does,
the others on the meta device, and every rank's shards are filled from rank 0's model.
``meta``: every rank builds on the meta device and the recipe's ``init_weights()`` fills
the shards.

Example (every rank; ``sailfin train`` does this itself)::

    with sharded_build(rank=dist.rank):
        module = MyRecipe(data)     # a real model on rank 0, meta tensors elsewhere
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from ..config.errors import ConfigError

BUILDS = ("rank0", "meta")
# What rank 0 built, held until every rank's shards are filled: its state dict (references
# to the model's own tensors: no copy) and its non-persistent buffers; empty elsewhere.
Start = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]


def sharded_build(rank: int, build: str = "rank0") -> ContextManager:
    """The context to construct a recipe in for the fsdp backends: nothing on rank 0
    (``build: rank0``), ``torch.device("meta")`` elsewhere. The data interface is built
    outside it: tensors a recipe's ``__init__`` makes are meta tensors on those ranks."""
    if build not in BUILDS:
        raise ConfigError(f"trainer.fsdp.build must be rank0 or meta, got {build!r}")
    if build == "rank0" and rank == 0:
        return contextlib.nullcontext()
    return torch.device("meta")


def is_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def capture_start(module: nn.Module, rank: int) -> Start:
    if rank != 0:
        return {}, {}
    if is_meta(module):
        raise ConfigError(
            "trainer.fsdp.build is rank0, but rank 0's model has meta tensors: rank 0 "
            "must build the recipe for real (sailfin.sharded_build does), or set "
            "trainer.fsdp.build meta and give the recipe init_weights()")
    state = {k: v.detach() for k, v in module.state_dict(keep_vars=True).items()}
    return state, {name: buf.detach() for name, buf in non_persistent_buffers(module)}


def non_persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    saved = module.state_dict(keep_vars=True).keys()
    return [(name, buf) for name, buf in module.named_buffers() if name not in saved]


def check_same_model(module: nn.Module, rank: int,
                     broadcast: Callable[[Any], Any]) -> None:
    """Every rank built the model rank 0 built (names, shapes, dtypes): one line naming
    the first tensor that differs, before any shard is filled."""
    mine = [(name, tuple(t.shape), str(t.dtype))
            for name, t in (*module.named_parameters(), *module.named_buffers())]
    theirs = broadcast(mine)
    if mine == theirs:
        return
    ours = {n: f"{list(shape)} {dtype}" for n, shape, dtype in mine}
    first = {n: f"{list(shape)} {dtype}" for n, shape, dtype in theirs}
    for name in [*first, *ours]:
        if ours.get(name) != first.get(name):
            raise ConfigError(
                f"rank {rank} built {name} as {ours.get(name, 'nothing')}, rank 0 as "
                f"{first.get(name, 'nothing')}: under fsdp every rank must build the same "
                "model (ranks but 0 run the recipe's __init__ under torch.device('meta')); "
                "make the model depend on its config only")


@torch.no_grad()
def receive_from_rank0(module: nn.Module, start: Start, rank: int,
                       device: torch.device, comm_device: torch.device,
                       every_rank_empty: bool = False) -> None:
    """Fill ``module``'s shards (already ``fully_shard``-ed) from rank 0's model.

    ``every_rank_empty`` (cpu_offload): every rank's shards are allocated anew in CPU
    memory, where FSDP2's offload policy requires them (``device`` is then the CPU);
    ``set_model_state_dict`` broadcasts on the collective's own device and copies each
    rank's rows into them."""
    state, buffers = start
    if every_rank_empty or is_meta(module):
        module.to_empty(device=device)  # this rank's rows only: the parameters are shards
    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True,
                                                                 broadcast_from_rank0=True))
    for name, buf in non_persistent_buffers(module):
        if rank == 0:
            buf.copy_(buffers[name])
        moved = buf.to(comm_device)  # the buffer itself when it is there already
        dist.broadcast(moved, src=0)
        if moved is not buf:
            buf.copy_(moved)
    _broadcast_plain_tensors(module, rank)
    state.clear()  # rank 0's whole model goes with these references
    buffers.clear()


@torch.no_grad()
def buffers_to(module: nn.Module, device: torch.device) -> None:
    """Under cpu_offload the shards live in CPU memory, buffers (masks, position ids,
    running statistics) where the forward runs."""
    for buf in module.buffers():
        if buf.device != device:
            buf.data = buf.to(device)


@torch.no_grad()
def init_on_shards(recipe: nn.Module, device: torch.device,
                   broadcast: Callable[[Any], Any]) -> None:
    """``build: meta``: allocate the shards and run the recipe's ``init_weights()`` on
    them, from rank 0's random state on every rank (replicated tensors agree)."""
    recipe.to_empty(device=device)
    state = broadcast(torch.get_rng_state())
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(state)
        recipe.init_weights()
    left = [name for name, t in (*recipe.named_parameters(), *recipe.named_buffers())
            if t.is_meta]
    if left:
        raise ConfigError(f"trainer.fsdp.build meta: {', '.join(left[:3])} still on the meta "
                          f"device after {type(recipe).__name__}.init_weights()")


def require_init_weights(recipe: nn.Module) -> None:
    if not callable(getattr(recipe, "init_weights", None)):
        raise ConfigError(
            f"trainer.fsdp.build is meta, but {type(recipe).__name__} has no init_weights(): "
            "give it one that fills every parameter and buffer in place, or set "
            "trainer.fsdp.build rank0 (rank 0 builds the model as sp does)")


def _broadcast_plain_tensors(module: nn.Module, rank: int) -> None:
    """Tensors a module keeps as plain attributes (a copy of a buffer kept aside) are
    neither parameters nor buffers: rank 0's values replace the meta ones elsewhere."""
    found = [(sub, name, value) for sub in module.modules() for name, value in vars(sub).items()
             if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)]
    if not found:
        return
    values = [[value.detach().cpu() if rank == 0 else None for _, _, value in found]]
    dist.broadcast_object_list(values, src=0)  # the same attributes on every rank
    for (sub, name, value), real in zip(found, values[0]):
        if value.is_meta and real is not None:
            setattr(sub, name, real)
