"""The batch plan: which global positions form each optimizer step, per rank.

Step k consumes positions ``[k*G, min((k+1)*G, N))`` of the epoch order, split
contiguously and evenly over the W ranks, each share cut into micro-batches of m
whose mean losses are weighted by ``count * W / n_step`` (docs/batch-plan.md). Every
rank runs the same number of micro-batches per step, so a collective inside the
forward meets its partners: a rank whose share fills one fewer runs one padding
micro-batch (the step's first sample) with weight 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Optional

from ..config.errors import ConfigError


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward of a step on one rank."""

    count: int        # samples in it
    weight: float     # multiply the micro-batch's mean loss by this
    last: bool        # the last micro-batch of the step on this rank (sync gradients)
    padding: bool = False  # one padding sample with weight 0 (see the module docstring)


@dataclass(frozen=True)
class BatchPlan:
    """Accumulation arithmetic for one global batch over ``world_size`` devices.

    Example::

        plan = BatchPlan.create(global_batch=64, micro_batch=16, world_size=2)
        plan.accumulation, plan.steps_in_epoch(1000)    # 2, 16 (the last has 40 samples)
    """

    global_batch: int
    micro_batch: int
    world_size: int
    accumulation: int
    drop_last: bool = False
    max_steps_per_epoch: Optional[int] = None

    @classmethod
    def create(cls, global_batch: int, micro_batch: Optional[int], world_size: int,
               drop_last: bool = False, max_steps_per_epoch: Optional[int] = None,
               micro_batch_limit: Optional[int] = None,
               note: Optional[Callable[[str], None]] = None) -> "BatchPlan":
        """``micro_batch`` is exact, except that one above a rank's share of the global batch
        is lowered to that share (``note`` gets one line saying so; the result is the
        same), so micro = global from one device runs as is on several.
        ``micro_batch_limit`` (PyMarlin's ``gpu_batch_size_limit``) is a ceiling: the
        largest micro batch within it that divides this world's share."""
        if world_size < 1:
            raise ConfigError(f"world size must be >= 1, got {world_size}")
        if micro_batch is not None and global_batch % world_size == 0 and \
                micro_batch > global_batch // world_size:
            share = global_batch // world_size
            if note is not None:
                note(f"trainer.micro_batch_size {micro_batch} is more than each of the "
                     f"{world_size} process(es)' share of trainer.train_batch_size "
                     f"{global_batch}: lowered to {share} (the global batch, and so the "
                     f"result, unchanged)")
            micro_batch = share
        if micro_batch is None and micro_batch_limit is not None:
            micro_batch = largest_micro_batch(global_batch, world_size, micro_batch_limit)
        if micro_batch is None:
            if global_batch % world_size:
                raise ConfigError(
                    f"trainer.train_batch_size={global_batch} does not split over "
                    f"{world_size} devices; set trainer.micro_batch_size or use a global "
                    f"batch that is a multiple of {world_size}")
            micro_batch = global_batch // world_size
        per_step = micro_batch * world_size
        if global_batch % per_step:
            raise ConfigError(
                f"trainer.train_batch_size={global_batch} is not a multiple of "
                f"micro_batch_size x world_size = {micro_batch} x {world_size} = {per_step}: "
                f"{_suggestions(global_batch, micro_batch, world_size)}")
        return cls(global_batch, micro_batch, world_size, global_batch // per_step,
                   drop_last, max_steps_per_epoch)

    @staticmethod
    def micro_batch_sizes(global_batch: int, world_size: int,
                          ceiling: Optional[int] = None) -> tuple[int, ...]:
        """Every micro-batch size a plan for (global batch, world size) allows, largest
        first, none above ``ceiling``: the sizes ``micro_batch_size: auto`` tries.
        E.g. ``BatchPlan.micro_batch_sizes(24, 2, ceiling=5)`` is ``(4, 3, 2, 1)``."""
        if world_size < 1 or global_batch % world_size:
            raise ConfigError(
                f"trainer.train_batch_size={global_batch} does not split over {world_size} "
                f"devices; use a global batch that is a multiple of {world_size}")
        top = global_batch // world_size
        if ceiling is not None:
            top = min(top, ceiling)
        return tuple(m for m in range(top, 0, -1) if global_batch % (m * world_size) == 0)

    def steps_in_epoch(self, num_samples: int) -> int:
        full, rest = divmod(num_samples, self.global_batch)
        steps = full + (1 if rest and not self.drop_last else 0)
        if self.max_steps_per_epoch is not None:
            steps = min(steps, self.max_steps_per_epoch)
        return steps

    def uniform_steps(self, num_samples: int) -> int:
        """How many leading steps of an epoch share one shape (all but a short last one)."""
        return num_samples // self.global_batch

    def sampler(self, num_samples: int, rank: int = 0, seed: int = 0, shuffle: bool = True,
                order: Any = None) -> Any:
        """The training sampler that follows this plan (a :class:`ResumableSampler`)."""
        from .sampler import ResumableSampler  # the sampler module imports this one

        return ResumableSampler(num_samples, self, rank, seed, shuffle, order=order)

    def step_positions(self, step: int, num_samples: int) -> tuple[int, int]:
        """Global positions ``[start, stop)`` of step ``step`` in the epoch order."""
        start = step * self.global_batch
        return start, min(start + self.global_batch, num_samples)

    def rank_positions(self, step: int, num_samples: int, rank: int) -> tuple[int, int, bool]:
        """This rank's real positions ``[lo, hi)`` of a step (possibly empty), and whether
        one padding sample (the step's first position) follows them."""
        start, stop = self.step_positions(step, num_samples)
        lo, hi = _split(stop - start, self.world_size, rank)
        pad = self.micro_batches(step, num_samples, rank)[-1].padding
        return start + lo, start + hi, pad

    def micro_batches(self, step: int, num_samples: int, rank: int) -> tuple[MicroBatch, ...]:
        """The micro-batches this rank runs for ``step``."""
        start, stop = self.step_positions(step, num_samples)
        return _micro_batches(self.micro_batch, self.world_size, stop - start, rank)


def largest_micro_batch(global_batch: int, world_size: int, limit: int) -> int:
    """The largest m <= ``limit`` with ``global_batch`` a multiple of m x ``world_size``:
    ``largest_micro_batch(96, 1, 40)`` is 32 (3 accumulation steps)."""
    if global_batch % world_size:
        lower = global_batch - global_batch % world_size
        raise ConfigError(
            f"trainer.train_batch_size={global_batch} does not split over {world_size} "
            f"devices, whatever the micro batch: use train_batch_size "
            f"{' or '.join(str(x) for x in (lower, lower + world_size) if x > 0)}")
    share = global_batch // world_size
    return max(m for m in range(1, min(limit, share) + 1) if share % m == 0)


def _split(n: int, parts: int, i: int) -> tuple[int, int]:
    """Part ``i`` of ``range(n)`` cut into ``parts`` contiguous, balanced pieces."""
    base, extra = divmod(n, parts)
    lo = i * base + min(i, extra)
    return lo, lo + base + (1 if i < extra else 0)


@lru_cache(maxsize=1024)
def _micro_batches(micro: int, world: int, n_step: int, rank: int, private: bool = False
                   ) -> tuple[MicroBatch, ...]:
    """``private`` (DP-SGD): weight 1, and at least one micro-batch (an empty step too)."""
    lo, hi = _split(n_step, world, rank)
    share = hi - lo
    # Every rank runs as many micro-batches as the largest share (rank 0's) needs.
    count = math.ceil(math.ceil(n_step / world) / micro)
    count = max(1, count) if private else count
    real = math.ceil(share / micro)  # count or count - 1 (the shares differ by at most 1)
    sizes = [micro] * (real - 1) + [share - micro * (real - 1)] if real else []
    out = [MicroBatch(c, 1.0 if private else c * world / n_step, i == count - 1)
           for i, c in enumerate(sizes)]
    if real < count:
        out.append(MicroBatch(count=1, weight=0.0, last=True, padding=True))
    return tuple(out)


def _suggestions(global_batch: int, micro: int, world: int) -> str:
    micros = [m for m in range(1, min(global_batch // world, 4 * micro) + 1)
              if global_batch % (m * world) == 0]
    near = sorted(micros, key=lambda m: (abs(m - micro), -m))[:3]
    lower = global_batch - global_batch % (micro * world)
    upper = lower + micro * world
    parts = []
    if near:
        parts.append(f"micro_batch_size {' or '.join(map(str, sorted(near)))} (or "
                     f"gpu_batch_size_limit {micro}: the largest micro batch within it)")
    parts.append(f"train_batch_size {' or '.join(str(x) for x in (lower, upper) if x > 0)}")
    if global_batch % micro == 0:  # after a resize: the world sizes this batch allows
        worlds = [w for w in range(1, global_batch // micro + 1) if global_batch % (micro * w) == 0]
        parts.append(f"a world size of {', '.join(map(str, worlds))}")
    return "use " + ", or ".join(parts)
