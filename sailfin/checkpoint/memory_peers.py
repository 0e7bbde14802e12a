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
    """Agreement and byte transfers between the ranks, for memory snapshots.

    Example (on every rank)::

        peers = Peers(rank, world_size)
        if peers.min(1 if wrote_fine else 0) == 0:
            raise RuntimeError("a rank failed")
        got = peers.exchange(my_bytes, dst=(rank + 1) % world, src=(rank - 1) % world)
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

    def exchange(self, data: bytes, dst: int, src: int) -> bytes:
        """Send ``data`` to ``dst`` while receiving ``src``'s (the writer thread)."""
        import torch.distributed as dist

        group = self._background
        size_out = torch.tensor([len(data)], dtype=torch.int64)
        size_in = torch.zeros(1, dtype=torch.int64)
        for req in (dist.isend(size_out, dst, group=group), dist.irecv(size_in, src, group=group)):
            req.wait()
        out = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        got = torch.empty(int(size_in.item()), dtype=torch.uint8)
        for req in (dist.isend(out, dst, group=group), dist.irecv(got, src, group=group)):
            req.wait()
        return got.numpy().tobytes()

    def send(self, data: bytes, dst: int) -> None:
        """Blocking send to one rank (resume: a replica to the rank that lost its own)."""
        import torch.distributed as dist

        dist.send(torch.tensor([len(data)], dtype=torch.int64), dst, group=self._group)
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, group=self._group)

    def recv(self, src: int) -> bytes:
        import torch.distributed as dist

        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, src, group=self._group)
        got = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(got, src, group=self._group)
        return got.numpy().tobytes()
