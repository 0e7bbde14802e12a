"""The hand-written side of overhead.py and short_run.py: the model, the data, and the
loaders a careful user would write without sailfin.

``batched_loader`` fetches exactly as sailfin's loader does for a ``TensorDataset``
(``sailfin/data/batched.py``): a ``DataLoader`` whose sampler is the epoch's
permutation (sailfin's: ``numpy.random.default_rng([seed, epoch])``, one list
per epoch), a dataset whose ``__getitems__`` gathers each batch with one
``index_select`` per tensor, and a collate function that passes the batch
through. ``per_sample_loader`` is the standard ``DataLoader`` (``dataset[i]``
per sample, then ``default_collate``) over the same order; ``direct_batches``
indexes the tensors without any ``DataLoader``. All three give the same batches
in the same order as sailfin with ``seed``, so every loop does the same work
per step and ends with the same weights.

    loader = batched_loader(make_data(256), seed=42, epoch=0)
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

BATCH = 32
SEED = 42  # sailfin's default trainer.seed: the same order as the hand loops


def make_model() -> nn.Module:
    """The tiny MLP every variant trains (64 -> 256 -> 256 -> 10)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def make_data(steps: int, batch: int = BATCH) -> TensorDataset:
    """``steps`` batches of random inputs and labels (fixed seed)."""
    g = torch.Generator().manual_seed(0)
    n = steps * batch
    return TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))


def epoch_order(n: int, seed: int = SEED, epoch: int = 0) -> list[int]:
    """The permutation sailfin's sampler draws for ``epoch`` (sailfin.data.sampler)."""
    return np.random.default_rng([seed, epoch]).permutation(n).tolist()


class BatchedTensors(Dataset):
    """Tensors whose ``__getitems__`` returns a whole collated batch (one gather each)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = tuple(tensors)

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[i] for t in self.tensors)

    def __getitems__(self, indices: Sequence[int]) -> list[torch.Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        return [t.index_select(0, index) for t in self.tensors]


def _as_is(batch: Any) -> Any:
    return batch


def batched_loader(ds: TensorDataset, seed: int = SEED, epoch: int = 0,
                   batch: int = BATCH) -> DataLoader:
    """Whole batches by index, as sailfin fetches them (see the module docstring)."""
    return DataLoader(BatchedTensors(ds.tensors), batch_size=batch,
                      sampler=epoch_order(len(ds), seed, epoch), collate_fn=_as_is)


def per_sample_loader(ds: TensorDataset, seed: int = SEED, epoch: int = 0,
                      batch: int = BATCH) -> DataLoader:
    """The standard DataLoader: one ``ds[i]`` per sample, then ``default_collate``."""
    return DataLoader(ds, batch_size=batch, sampler=epoch_order(len(ds), seed, epoch))


def direct_batches(ds: TensorDataset, seed: int = SEED, epoch: int = 0,
                   batch: int = BATCH) -> Iterator[list[torch.Tensor]]:
    """No DataLoader: slices of the permutation, one ``index_select`` per tensor."""
    order = torch.as_tensor(epoch_order(len(ds), seed, epoch))
    for lo in range(0, len(order), batch):
        index = order[lo:lo + batch]
        yield [t.index_select(0, index) for t in ds.tensors]


def synchronize(device: str) -> None:
    """Wait for the device's queued work, so a clock read after it counts that work."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def fingerprint(model: nn.Module) -> float:
    """A number that changes with any trained weight: the same work gives the same value."""
    with torch.no_grad():
        return float(sum(p.double().sum() * (i + 1) for i, p in enumerate(model.parameters())))
