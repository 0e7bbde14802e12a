"""Epoch orders, and the samplers that follow the batch plan and resume at any step.

The order of epoch ``e`` is a pure function of (dataset length, seed, e) (for
shards: of samples per shard, seed, e, window): not of the world size, the micro
batch or the worker count, so a run resumed on another world size continues it.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from ..config.errors import ConfigError
from .plan import BatchPlan, MicroBatch, _split


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Global sample order of an epoch (positions -> dataset indices)."""
    if not shuffle:
        return np.arange(num_samples)
    # Its own generator: drawing from torch's global RNG here would change the
    # random stream the recipe sees (dropout, augmentation) and break resume.
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 64-bit seed for sample ``index`` in ``epoch``: augmentation drawn from it is the
    same whichever rank, worker or resumed run loads the sample.

    Example (a dataset whose ``set_epoch`` the trainer calls before each epoch)::

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(sample_seed(self.seed, self.epoch, i))
            return self.images[i] + 0.1 * torch.randn(self.images[i].shape, generator=g)
    """
    state = np.random.SeedSequence([seed, epoch, index, 0x5A3D]).generate_state(2, np.uint32)
    return int(state[0]) << 32 | int(state[1])


def window_order(counts: Sequence[int], seed: int, epoch: int, window: int,
                 shuffle: bool = True) -> np.ndarray:
    """The epoch order over shards of ``counts`` samples each (shards in the order given):
    shards shuffled, then samples shuffled within windows of ``window`` consecutive
    shards. Any stretch of positions (a step, a rank's share) then reads from at most two
    windows: a bounded set of shards, which keeps a remote cache small.

    Example::

        window_order([3, 2, 4], seed=0, epoch=0, window=2)   # a permutation of range(9)
    """
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if not shuffle:
        return np.arange(total)
    if window < 1:
        raise ValueError(f"shuffle_window must be >= 1, got {window}")
    starts = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    # A generator of its own, with a tag distinct from epoch_order's (see there).
    rng = np.random.default_rng([seed, epoch, 0x5A4D])
    shards = rng.permutation(len(counts))
    out = np.empty(total, dtype=np.int64)
    pos = 0
    for w in range(0, len(shards), window):
        chosen = shards[w:w + window]
        ids = np.concatenate([np.arange(starts[s], starts[s] + counts[s]) for s in chosen])
        rng.shuffle(ids)
        out[pos:pos + len(ids)] = ids
        pos += len(ids)
    return out


EpochOrder = Callable[[int, int], np.ndarray]


@runtime_checkable
class OrderedDataset(Protocol):
    """A dataset that chooses its own epoch order (a sharded one reads shard by shard):
    ``epoch_order(seed, epoch)``, a permutation of ``range(len(dataset))`` that depends
    on nothing else."""

    def __len__(self) -> int: ...

    def epoch_order(self, seed: int, epoch: int) -> np.ndarray: ...


class ResumableSampler(torch.utils.data.Sampler[int]):
    """This rank's dataset indices for the steps ``[start_step, steps_in_epoch)``, in the
    order ``order(seed, epoch)`` gives (an :class:`OrderedDataset`'s ``epoch_order``)
    or the default permutation; ``shuffle=False``: the natural order.

    Example::

        sampler = ResumableSampler(len(ds), plan, rank=0, seed=42)
        sampler.set_epoch(3, start_step=10)     # resume in the middle of epoch 3
        loader = DataLoader(ds, batch_size=plan.micro_batch, sampler=sampler)
    """

    def __init__(self, num_samples: int, plan: BatchPlan, rank: int = 0, seed: int = 0,
                 shuffle: bool = True, order: Optional[EpochOrder] = None) -> None:
        if num_samples < 1:
            raise ConfigError("the training set is empty: get_train_dataset() returned a "
                              "dataset of length 0; check the data: section (its paths, "
                              "filters and sizes)")
        if not 0 <= rank < plan.world_size:
            raise ValueError(f"rank {rank} is outside world size {plan.world_size}")
        self.num_samples, self.plan, self.rank = num_samples, plan, rank
        self.seed, self.shuffle, self.order = seed, shuffle, order
        self.epoch = self.start_step = 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.epoch = epoch
        self.start_step = start_step

    @property
    def steps_in_epoch(self) -> int:
        return self.plan.steps_in_epoch(self.num_samples)

    def _ranges(self):
        """This rank's positions per step: its share, then a padding sample if it has one."""
        for step in range(self.start_step, self.steps_in_epoch):
            lo, hi, pad = self.plan.rank_positions(step, self.num_samples, self.rank)
            yield lo, hi
            if pad:  # the step's first sample, with weight 0 (see BatchPlan)
                first, _ = self.plan.step_positions(step, self.num_samples)
                yield first, first + 1

    def epoch_order(self, epoch: Optional[int] = None) -> np.ndarray:
        """Positions -> dataset indices for ``epoch`` (default: the current epoch)."""
        epoch = self.epoch if epoch is None else epoch
        if self.order is None or not self.shuffle:
            return epoch_order(self.num_samples, self.seed, epoch, self.shuffle)
        order = np.asarray(self.order(self.seed, epoch))
        if order.shape != (self.num_samples,):
            raise ValueError(f"the dataset's epoch_order returned {order.shape[0]} positions "
                             f"for {self.num_samples} samples; it must be a permutation of "
                             "range(len(dataset))")
        return order

    def _span(self) -> Optional[tuple[int, int]]:
        """On one rank, the steps left form one run of positions: ``[lo, hi)``."""
        if self.plan.world_size != 1:
            return None
        lo, _ = self.plan.step_positions(self.start_step, self.num_samples)
        steps = self.steps_in_epoch
        _, hi = self.plan.step_positions(steps - 1, self.num_samples) if steps else (0, 0)
        return lo, max(lo, hi)

    def __iter__(self) -> Iterator[int]:
        order = self.epoch_order()
        # One list per epoch: cheaper per sample than yielding slice by slice.
        span = self._span()
        if span is not None:
            return iter(order[span[0]:span[1]].tolist())
        parts = [order[lo:hi] for lo, hi in self._ranges()]
        return iter(np.concatenate(parts).tolist() if parts else [])

    def __len__(self) -> int:
        span = self._span()
        if span is not None:
            return span[1] - span[0]
        return sum(hi - lo for lo, hi in self._ranges())

    def micro_batches(self, step: int) -> tuple[MicroBatch, ...]:
        """This rank's micro-batches of ``step`` in the current epoch."""
        return self.plan.micro_batches(step, self.num_samples, self.rank)

    def step_samples(self, step: int) -> int:
        """Samples (over all ranks) in ``step``, padding excluded."""
        lo, hi = self.plan.step_positions(step, self.num_samples)
        return hi - lo

    def step_indices(self, epoch: int, step: int) -> list[int]:
        """Dataset indices of every rank's samples in optimizer step ``step`` of ``epoch``."""
        lo, hi = self.plan.step_positions(step, self.num_samples)
        return self.epoch_order(epoch)[lo:hi].tolist()


class EvalSampler(torch.utils.data.Sampler[int]):
    """A contiguous, in-order share of the dataset, no padding: every rank's outputs
    concatenated in rank order are in dataset order."""

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1) -> None:
        self.lo, self.hi = _split(num_samples, world_size, rank)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.lo, self.hi))

    def __len__(self) -> int:
        return self.hi - self.lo
