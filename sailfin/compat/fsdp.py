"""Private attributes of torch's FSDP2 that sailfin uses, each with its public alternative."""

from __future__ import annotations

from torch.distributed.fsdp import FSDPModule


def settle_roots(root: FSDPModule) -> None:
    """Make ``root`` the FSDP root now, not at its first forward.

    FSDP2 decides which module is the root at the first forward through any FSDP
    module. sailfin's validation (the start-up sanity batch runs before any training
    step) calls the units directly, and each would then make itself a root. There is
    no public call for this in torch 2.13 (FSDPModule has none; upstream: the lazy
    init is internal to ``FSDPState``); the public alternative would be a forward
    through the root before validation, which runs a train_step.
    """
    root._get_fsdp_state()._lazy_init()  # type: ignore[attr-defined]


def missing() -> list[str]:
    """The dotted names of the private attributes above that this torch lacks."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    out = []
    if not hasattr(FSDPModule, "_get_fsdp_state"):
        out.append("torch.distributed.fsdp.FSDPModule._get_fsdp_state")
    if not hasattr(FSDPState, "_lazy_init"):
        out.append("torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._lazy_init")
    return out
