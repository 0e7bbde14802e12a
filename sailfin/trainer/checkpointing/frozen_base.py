"""The fingerprint of a frozen base: what a parameter-efficient fine-tune's checkpoint (which
leaves the base out) records of it, so a resume or an ``init_from`` refuses another base.

Per frozen parameter: name, shape, dtype and the CRC-32 of its bytes, which sees order
(rows swapped, a tensor reversed or transposed, two elements exchanged). It is computed
tensor by tensor, in chunks: no copy of the base, and on a GPU at most one chunk on the
host at a time; under fsdp each tensor is gathered whole, one at a time, on every rank.

Example::

    saved = fingerprint(module)            # [[name, shape, dtype, "crc32:0a1b2c3d"], ...]
    why = mismatch(saved, fingerprint(other))   # "" when the bases agree
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ...utils.crc import crc32

_FROZEN: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[frozenset, list]]" = (
    weakref.WeakKeyDictionary())
CHUNK_BYTES = 64 << 20  # what goes through the checksum (and, from a GPU, the host) at once
PREFIX = "crc32:"


def frozen_names(module: torch.nn.Module) -> frozenset[str]:
    """The state-dict names of ``module``'s parameters that do not train."""
    return _frozen(module)[0]


def fingerprint(module: torch.nn.Module) -> list[list[Any]]:
    """What identifies the frozen base (computed once per module: it does not change)."""
    return _frozen(module)[1]


def _frozen_params(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in module.named_parameters(remove_duplicate=False)
            if not p.requires_grad]


def _frozen(module: torch.nn.Module) -> tuple[frozenset, list]:
    cached = _FROZEN.get(module)
    if cached is None:
        frozen = _frozen_params(module)
        prints = [[name, list(p.shape), _dtype(p), f"{PREFIX}{tensor_crc32(p):08x}"]
                  for name, p in frozen]
        cached = _FROZEN[module] = (frozenset(n for n, _ in frozen), prints)
    return cached


def _dtype(p: torch.Tensor) -> str:
    return str(p.dtype).replace("torch.", "")


@torch.no_grad()
def tensor_crc32(tensor: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> int:
    """The CRC-32 of ``tensor``'s bytes in row-major order (a DTensor: of the whole tensor,
    gathered; a collective every rank must call)."""
    value = tensor.detach()
    full = getattr(value, "full_tensor", None)  # a DTensor (fsdp): the whole tensor
    if full is not None:
        value = full()
    flat = value.reshape(-1)  # a view for the contiguous tensors parameters are
    step = max(1, chunk_bytes // max(1, flat.element_size()))
    crc = 0
    for start in range(0, flat.numel(), step):
        part = flat[start:start + step]
        if part.device.type != "cpu":
            part = part.cpu()  # one chunk on the host at a time
        crc = crc32(part.contiguous().view(torch.uint8).numpy(), crc)
    return crc


def mismatch(saved: Any, module: torch.nn.Module) -> str:
    """Why ``saved`` (a checkpoint's fingerprint) is not ``module``'s frozen base, as a
    clause ("it was trained on another frozen base: ..."); "" when they agree. The
    fingerprint of an older sailfin (sums per tensor) is checked as it was taken."""
    if not (isinstance(saved, list) and all(
            isinstance(e, (list, tuple)) and len(e) in (4, 5) and isinstance(e[0], str)
            for e in saved)):
        return ("its fingerprint of the frozen base is unreadable (not a list of [name, "
                "shape, dtype, checksum]): it is damaged or was rewritten; use another "
                "checkpoint")
    legacy = any(len(e) == 5 for e in saved)
    now = _legacy(module) if legacy else fingerprint(module)
    saved_by = {entry[0]: list(entry) for entry in saved}
    now_by = {entry[0]: list(entry) for entry in now}
    other = "it was trained on another frozen base"
    if set(saved_by) != set(now_by):
        extra = sorted(set(saved_by) ^ set(now_by))[:3]
        return (f"{other}: the frozen parameters differ by name ({len(saved_by)} saved, "
                f"{len(now_by)} now; e.g. {', '.join(extra)})")
    what = "shape/dtype/sum" if legacy else "shape/dtype/checksum"
    for name, entry in now_by.items():
        if saved_by[name] != entry:
            return (f"{other}: frozen parameter {name} differs (saved {what} "
                    f"{saved_by[name][1:]}, now {entry[1:]})")
    return ""


def _legacy(module: torch.nn.Module) -> list[list[Any]]:
    """The fingerprint sailfin wrote before checksums: per tensor, its float64 sum and sum
    of squares (blind to order: kept only to read those checkpoints)."""
    return [[name, list(p.shape), _dtype(p), _figure(p.detach().double().sum()),
             _figure(p.detach().double().square().sum())]
            for name, p in _frozen_params(module)]


def _figure(value: torch.Tensor) -> float:
    full = getattr(value, "full_tensor", None)  # a DTensor (fsdp): reduced over the ranks
    return float(f"{float(full() if full else value):.10g}")
