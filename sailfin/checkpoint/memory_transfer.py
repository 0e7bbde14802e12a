"""Snapshots between ranks: the agreement, and moving a snapshot directory, each byte once.

Snapshot files are CPU bytes, so they travel over gloo whatever the training
backend (nccl included), on groups of their own (:class:`Peers`) that keep the
background replica transfers from interleaving with training's collectives.

A replica is a snapshot directory copied to a rank on another node, each file from
its pages on the sender to the new file's pages on the receiver, under
``.tmp-step-N`` and renamed when every file has arrived.

Example (on two ranks, each sending its newest snapshot and receiving the other's)::

    exchange(group, "/dev/shm/x/rank00000/step-00000012", dst=1, src=1,
             into="/dev/shm/x/replica-rank00001", step=12)
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist

from .memory_dirs import step_name
from .memory_staging import reserve


class Peers:
    """Agreement between the ranks, and the groups snapshots travel on (local on one
    process).

    Example (on every rank)::

        peers = Peers(world_size)
        peers.start()
        if peers.min(1 if wrote_fine else 0) == 0:
            raise RuntimeError("a rank failed")
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.group: Any = None  # the step's agreement and resume's transfers
        self.background: Any = None  # the writer thread's replicas

    def start(self) -> None:
        """Create the groups (a collective: every rank calls it at the same point)."""
        if self.world_size > 1 and self.group is None and dist.is_initialized():
            self.group = dist.new_group(backend="gloo")
            self.background = dist.new_group(backend="gloo")

    def min(self, value: int) -> int:
        """The smallest of every rank's ``value``."""
        if self.group is None:
            return value
        box = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self.group)
        return int(box.item())

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


def exchange(group: Any, path: Optional[str], dst: Optional[int], src: Optional[int],
             into: str, step: int) -> Optional[str]:
    """Send the snapshot ``path`` to ``dst`` while receiving ``src``'s as
    ``into/step-N``; returns the received directory. ``path`` None: this rank dropped its
    snapshot of ``step`` and sends an empty header. ``dst`` or ``src`` None: only
    receive, or only send."""
    where = path or ""
    sizes = {n: os.path.getsize(os.path.join(where, n)) for n in sorted(os.listdir(where))
             } if path is not None else {}
    header = torch.frombuffer(bytearray(json.dumps(sizes).encode("utf-8")), dtype=torch.uint8)
    length = torch.zeros(1, dtype=torch.int64)
    _move(group, [torch.tensor([header.numel()], dtype=torch.int64)], dst, [length], src)
    got = torch.empty(int(length.item()), dtype=torch.uint8)
    _move(group, [header], dst, [got], src)
    incoming = json.loads(got.numpy().tobytes().decode("utf-8")) if src is not None else {}
    staging = os.path.join(into, f".tmp-{step_name(step)}")
    if src is not None:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    # Each file's bytes as a tensor on its own pages: the sender's mapped privately (no
    # copy), the receiver's a new file mapped shared, its pages reserved first (a full
    # file system is an error here, not a SIGBUS later).
    outgoing = [torch.from_file(os.path.join(where, name), shared=False, size=size,
                                dtype=torch.uint8) for name, size in sizes.items() if size]
    targets = []
    for name, size in sorted(incoming.items()):
        reserve(os.path.join(staging, name), size)
        targets.append(torch.from_file(os.path.join(staging, name), shared=True, size=size,
                                       dtype=torch.uint8))
    _move(group, outgoing, dst, targets, src)
    if not incoming:  # only sent, or the sender dropped its snapshot of this step
        if src is not None:
            shutil.rmtree(staging, ignore_errors=True)
        return None
    final = os.path.join(into, step_name(step))
    shutil.rmtree(final, ignore_errors=True)
    os.rename(staging, final)
    return final


def send(group: Any, path: str, dst: int) -> None:
    """Send the snapshot ``path`` to ``dst`` (a replica going back on resume)."""
    exchange(group, path, dst, None, "", 0)


def recv(group: Any, src: int, into: str, step: int) -> Optional[str]:
    """Receive what :func:`send` sent as ``into/step-N``; returns that directory."""
    return exchange(group, None, None, src, into, step)


def _move(group: Any, out: list[torch.Tensor], dst: Optional[int], into: list[torch.Tensor],
          src: Optional[int]) -> None:
    """Send ``out`` to ``dst`` while receiving ``into`` from ``src``, empty ones not at
    all; return once every transfer is done."""
    requests = [dist.isend(t, dst, group=group) for t in out if dst is not None and t.numel()]
    requests += [dist.irecv(t, src, group=group) for t in into
                 if src is not None and t.numel()]
    for request in requests:
        request.wait()
