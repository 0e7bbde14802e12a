"""Batched fetching: a micro-batch of in-memory tensors in one gather, not one call per sample.

A ``DataLoader`` over a ``TensorDataset`` calls ``dataset[i]`` per sample, then
``default_collate`` stacks them: for a small model a large share of the step. When a
recipe's loader is the documented ``DataLoader(dataset, batch_size=batch_size,
sampler=sampler(dataset))`` over a ``TensorDataset`` (or ``Subset`` of one), sailfin
rebuilds it over a view that gathers each micro-batch with one ``index_select`` per
tensor. The batches are bit-identical; where that cannot be promised (:func:`can_gather`)
the loader is used as it is.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional, Sequence

import torch
from torch.utils.data import DataLoader, Subset, TensorDataset, default_collate

# Built again from the recipe's loader as they are; the rest is sailfin's choice.
_REBUILT = {"dataset", "shuffle", "batch_sampler", "collate_fn"}


class GatheredTensors(torch.utils.data.Dataset):
    """A view of a ``TensorDataset`` (or nested ``Subset`` of one) that gathers batches:
    ``view[i]`` is ``source[i]``; ``view.__getitems__(indices)`` is the micro-batch
    ``default_collate`` would make (the loader's collate is then :func:`pass_through`).

    Example::

        ds = TensorDataset(torch.randn(100, 4), torch.arange(100))
        x, y = GatheredTensors(ds).__getitems__([3, 1, 2])     # y == tensor([3, 1, 2])
    """

    def __init__(self, source: Any) -> None:
        self.source = source
        base, positions = source, None
        while type(base) is Subset:  # compose the index maps down to the tensors
            index = torch.as_tensor(base.indices, dtype=torch.long)
            positions = index if positions is None else index[positions]
            base = base.dataset
        self.base: TensorDataset = base
        self.positions: Optional[torch.Tensor] = positions
        self._on_cpu = all(t.device.type == "cpu" for t in base.tensors)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> Any:
        return self.source[index]

    def __getitems__(self, indices: Sequence[int]) -> list[torch.Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        if self.positions is not None:
            index = self.positions[index]
        if self._on_cpu and torch.utils.data.get_worker_info() is None:  # the common case
            return [t.index_select(0, index) for t in self.base.tensors]
        return [_gather(t, index) for t in self.base.tensors]


def _gather(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if tensor.device.type != "cpu":
        return tensor.index_select(0, index.to(tensor.device))
    if torch.utils.data.get_worker_info() is not None:
        # As default_collate does in a worker: write the batch straight into shared
        # memory, so sending it to the main process copies nothing more.
        out = torch.empty((len(index), *tensor.shape[1:]), dtype=tensor.dtype).share_memory_()
        return torch.index_select(tensor, 0, index, out=out)
    return tensor.index_select(0, index)


def pass_through(batch: list[torch.Tensor]) -> list[torch.Tensor]:
    """The collate function of a gathered loader: the view collated the batch already."""
    return batch


def can_gather(loader: Any, sampler: Any) -> bool:
    """Whether ``loader`` can be rebuilt over :class:`GatheredTensors` with identical batches."""
    if type(loader) is not DataLoader or loader.sampler is not sampler:
        return False
    if loader.collate_fn is not default_collate or loader.batch_size is None:
        return False
    if not isinstance(loader.batch_sampler, torch.utils.data.BatchSampler) or \
            loader.batch_sampler.sampler is not sampler:
        return False  # the recipe passed its own batch_sampler
    dataset = loader.dataset
    while type(dataset) is Subset:
        if callable(getattr(dataset, "set_epoch", None)):
            return False
        dataset = dataset.dataset
    return (type(dataset) is TensorDataset and len(dataset.tensors) > 0
            and not callable(getattr(dataset, "set_epoch", None)))


def gathered_loader(loader: Any, sampler: Any) -> Any:
    """``loader`` rebuilt to gather micro-batches (see the module docstring), or ``loader``
    itself when that could change a batch."""
    if not can_gather(loader, sampler):
        return loader
    return rebuilt(loader, GatheredTensors(loader.dataset), pass_through) or loader


def rebuilt(loader: DataLoader, dataset: Any, collate_fn: Any, **given: Any
            ) -> Optional[DataLoader]:
    """A ``DataLoader`` over ``dataset`` and ``collate_fn`` with every other argument
    ``loader`` was built with (workers, pinning, generator, ...) unless ``given``; None
    when ``loader`` lacks one (a ``DataLoader`` argument this code cannot carry)."""
    kwargs = {}
    for name in inspect.signature(DataLoader.__init__).parameters:
        if name == "self" or name in _REBUILT or name in given:
            continue
        if not hasattr(loader, name):
            return None
        kwargs[name] = getattr(loader, name)
    return DataLoader(dataset, collate_fn=collate_fn, **kwargs, **given)
