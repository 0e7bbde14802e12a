"""Random streams: capture and restore them per rank, and keep the data loader off them
(creating a DataLoader iterator would draw a seed from torch's global generator).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """This process's random streams, as tensors and plain types (``weights_only`` loadable)."""
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"bit_generator": np_state["bit_generator"],
                  "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                  "pos": int(np_state["state"]["pos"]),
                  "has_gauss": int(np_state["has_gauss"]),
                  "gauss": float(np_state["gauss"])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> list[str]:
    """Put every stream back where :func:`rng_state` found it; return notes for the user."""
    random.setstate(_as_tuples(state["python"]))
    np_state = state["numpy"]
    np.random.set_state({"bit_generator": np_state["bit_generator"],
                         "state": {"key": np_state["key"].numpy().astype(np.uint32),
                                   "pos": np_state["pos"]},
                         "has_gauss": np_state["has_gauss"], "gauss": np_state["gauss"]})
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if not cuda:
        return []
    if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)
        return []
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [f"the checkpoint holds random state for {len(cuda)} CUDA devices and this "
            f"process sees {have}: CUDA random streams start afresh"]


def derive_rng(seed: int, rank: int, step: int) -> None:
    """Seed every stream from (seed, rank, step): for a rank the checkpoint has no state for."""
    derived = _derived(seed, rank, step)
    random.seed(derived)
    np.random.seed(derived)
    torch.manual_seed(derived)


def seed_loader(loader: Any, seed: int, epoch: int, rank: int) -> None:
    """Give the loader its own generator for this epoch: sailfin's sampler decides the
    order, so it only seeds workers, and ``iter(loader)`` draws nothing from torch's."""
    if hasattr(loader, "generator"):
        loader.generator = torch.Generator().manual_seed(_derived(seed, epoch, rank, 0x5A11))


def _derived(*key: int) -> int:
    return int(np.random.SeedSequence(list(key)).generate_state(1)[0])


def _as_tuples(value: Any) -> Any:
    """``random.setstate`` wants tuples; a round trip may have made lists."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuples(v) for v in value)
    return value
