"""The collectives memory snapshots need, on a gloo process group of their own.

Snapshot files are CPU bytes, so they travel over gloo whatever the training
backend (nccl included), and a group of their own keeps the background replica
transfers from interleaving with training's collectives. On one process every
method is local.
"""

from __future__ import annotations

from typing import Any

import torch


class Peers:
    """Agreement between the ranks, and the groups snapshots travel on.

    Example (on every rank)::

        peers = Peers(rank, world_size)
        if peers.min(1 if wrote_fine else 0) == 0:
            raise RuntimeError("a rank failed")
        memory_transfer.exchange(peers.background, path, dst, src, into, step)
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self._group: Any = None
        self._background: Any = None

    def start(self) -> None:
        """Create the groups (a collective: every rank calls it at the same point)."""
        import torch.distributed as dist

        if self.world_size > 1 and self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")       # the step's agreement, resume
            self._background = dist.new_group(backend="gloo")  # the writer thread's replicas

    @property
    def distributed(self) -> bool:
        return self._group is not None

    @property
    def group(self) -> Any:
        """The group for agreement and resume's transfers (None on one process)."""
        return self._group

    @property
    def background(self) -> Any:
        """The group the writer thread sends replicas on."""
        return self._background

    def min(self, value: int) -> int:
        """The smallest of every rank's ``value``."""
        if not self.distributed:
            return value
        import torch.distributed as dist

        box = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self._group)
        return int(box.item())

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._group)
        return out
