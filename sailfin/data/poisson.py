"""The batch plan and sampler of differentially private training (docs/dp.md, "The batch").

DP-SGD clips each sample's gradient, so a micro-batch's mean loss is never
re-weighted (:class:`PrivatePlan`). Poisson sampling (:class:`PoissonPlan`) draws
step k of epoch e from (seed, e, k) alone, the same on every rank and world size, so
a resumed run draws the same batches; an empty step is one weight-0 padding
micro-batch: its noise is still added and its step still accounted.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterator, Optional

import numpy as np
import torch

from .plan import BatchPlan, MicroBatch, _micro_batches, _split
from .sampler import ResumableSampler


@dataclass(frozen=True)
class PrivatePlan(BatchPlan):
    """A :class:`BatchPlan` whose micro-batches are not re-weighted (DP-SGD averages
    clipped per-sample gradients over the expected batch itself).

    Example::

        PrivatePlan.from_plan(BatchPlan.create(64, 16, 1)).micro_batches(0, 1000, 0)[0].weight  # 1
    """

    @classmethod
    def from_plan(cls, plan: BatchPlan, **extra: Any) -> "PrivatePlan":
        return cls(plan.global_batch, plan.micro_batch, plan.world_size, plan.accumulation,
                   plan.drop_last, plan.max_steps_per_epoch, **extra)

    def micro_batches(self, step: int, num_samples: int, rank: int) -> tuple[MicroBatch, ...]:
        start, stop = self.step_positions(step, num_samples)
        return _micro_batches(self.micro_batch, self.world_size, stop - start, rank, True)

    def sampler(self, num_samples: int, rank: int = 0, seed: int = 0, shuffle: bool = True,
                order: Any = None) -> "PrivateSampler":
        return PrivateSampler(num_samples, self, rank, seed, shuffle, order=order)


class PrivateSampler(ResumableSampler):
    """A :class:`ResumableSampler` whose loader must sample with it alone
    (:meth:`check_loader`): ``poisson_sampling: false``, and the base of Poisson's."""

    def check_loader(self, loader: Any) -> None:
        """Refuse a training loader that does not sample with this sampler alone: the
        privacy accountant assumes sailfin's sampling, so a recipe's own sampler or batch
        sampler, ``drop_last`` or another dataset would make epsilon wrong silently."""
        from torch.utils.data import BatchSampler, DataLoader

        name = type(loader).__name__
        if not isinstance(loader, DataLoader):
            wrong = "is not a torch DataLoader: sailfin cannot see how it samples"
        elif not (type(loader.batch_sampler) is BatchSampler
                  and loader.batch_sampler.sampler is loader.sampler):
            wrong = (f"samples with its own batch sampler "
                     f"({type(loader.batch_sampler).__name__})")
        elif loader.sampler is not self:
            wrong = f"samples with its own sampler ({type(loader.sampler).__name__})"
        elif loader.drop_last:
            wrong = "drops the last micro-batch (drop_last=True)"
        elif len(loader.dataset) != self.num_samples:
            wrong = (f"reads a dataset of {len(loader.dataset)} samples, not the "
                     f"{self.num_samples} it passed to sampler(dataset)")
        else:
            return
        raise ValueError(
            f"get_train_dataloader returned a {name} that {wrong}; under a -dp backend each "
            "step's samples must be the ones sailfin's sampler draws (the privacy accountant "
            "assumes its sampling rate): build it as DataLoader(dataset, batch_size=batch_size, "
            "sampler=sampler(dataset))")


@dataclass(frozen=True)
class PoissonPlan(PrivatePlan):
    """Poisson sampling: the global batch is the expected logical batch of a step;
    ``seed`` replaces the run's seed for the draws (``trainer.dp.secure_rng``).

    Example::

        sampler = PoissonPlan.from_plan(BatchPlan.create(64, 16, 1)).sampler(1000, seed=42)
        sampler.micro_batches(0)     # this step's micro-batches, e.g. sizes 16, 16, 16, 16, 3
    """

    seed: Optional[int] = None

    def uniform_steps(self, num_samples: int) -> int:
        return 0  # every step has its own shape

    def sampler(self, num_samples: int, rank: int = 0, seed: int = 0, shuffle: bool = True,
                order: Any = None) -> "PoissonSampler":
        return PoissonSampler(num_samples, self, rank, seed if self.seed is None else self.seed)


@lru_cache(maxsize=64)
def poisson_draw(num_samples: int, rate: float, seed: int, epoch: int, step: int
                 ) -> np.ndarray:
    """Dataset indices of step ``step`` of ``epoch``: each sample independently with
    probability ``rate`` (a binomial count, then that many distinct samples uniformly:
    the same distribution, in time proportional to the batch, not to N)."""
    rng = np.random.default_rng([seed, epoch, step, 0xD1FF])
    count = int(rng.binomial(num_samples, rate))
    drawn = rng.choice(num_samples, size=count, replace=False)
    drawn.setflags(write=False)
    return drawn


class PoissonSampler(PrivateSampler):
    """This rank's dataset indices for the Poisson steps ``[start_step, steps_in_epoch)``:
    flat when iterated, per micro-batch from :meth:`batches` (the loader's batch sampler).

    Example::

        sampler = PoissonSampler(1000, PoissonPlan.from_plan(BatchPlan.create(64, 16, 1)))
        sampler.set_epoch(2, start_step=5)
        [len(b) for b in sampler.batches()][:3]
    """

    def __init__(self, num_samples: int, plan: BatchPlan, rank: int = 0, seed: int = 0) -> None:
        super().__init__(num_samples, plan, rank, seed, shuffle=True)
        self.rate = min(1.0, plan.global_batch / num_samples)

    def draw(self, step: int, epoch: Optional[int] = None) -> np.ndarray:
        """Every rank's dataset indices of ``step`` (default: in the current epoch)."""
        epoch = self.epoch if epoch is None else epoch
        return poisson_draw(self.num_samples, self.rate, self.seed, epoch, step)

    def micro_batches(self, step: int) -> tuple[MicroBatch, ...]:
        return _micro_batches(self.plan.micro_batch, self.plan.world_size,
                              len(self.draw(step)), self.rank, True)

    def step_samples(self, step: int) -> int:
        return len(self.draw(step))

    def step_indices(self, epoch: int, step: int) -> list[int]:
        return self.draw(step, epoch).tolist()

    def batches(self) -> Iterator[list[int]]:
        """This rank's micro-batches (lists of dataset indices) of the remaining steps."""
        micro, world = self.plan.micro_batch, self.plan.world_size
        for step in range(self.start_step, self.steps_in_epoch):
            drawn = self.draw(step)
            lo, hi = _split(len(drawn), world, self.rank)
            mine = drawn[lo:hi].tolist()
            for i, mb in enumerate(self.micro_batches(step)):
                if mb.padding:  # the step's first sample (any sample of an empty step)
                    yield [int(drawn[0]) if len(drawn) else 0]
                else:
                    yield mine[i * micro:i * micro + mb.count]

    def __iter__(self) -> Iterator[int]:
        return (i for batch in self.batches() for i in batch)

    def __len__(self) -> int:
        return sum(len(b) for b in self.batches())

    def wrap_loader(self, loader: Any) -> Any:
        """The recipe's loader rebuilt to read this sampler's micro-batches of varying size
        (as Opacus's ``DPDataLoader`` rebuilds one with its batch sampler): same dataset,
        collate function, workers and pinning."""
        from .batched import GatheredTensors, can_gather, pass_through, rebuilt

        dataset, collate = loader.dataset, loader.collate_fn
        if can_gather(loader, self):  # in-memory tensors: one gather per micro-batch
            dataset, collate = GatheredTensors(loader.dataset), pass_through
        return rebuilt(loader, dataset, collate, batch_sampler=_Batches(self), batch_size=1,
                       sampler=None, drop_last=False)


class _Batches(torch.utils.data.Sampler[list[int]]):
    def __init__(self, sampler: PoissonSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[int]]:
        return self.sampler.batches()

    def __len__(self) -> int:
        return sum(1 for _ in self.sampler.batches())
