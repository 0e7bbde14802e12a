"""Moving a snapshot directory to another rank's memory, each byte once.

A replica is a snapshot directory copied to a rank on another node. Each file
is sent straight from its pages in the sender's file system (mapped, not read
into a buffer) and received straight into the pages of the new file on the
receiver's (mapped shared, reserved first); a small header of names and sizes
goes ahead. The copy is written under ``.tmp-step-N`` and renamed when every
file has arrived: complete or not at all.

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

from .memory_files import step_name
from .memory_staging import reserve


def _header(path: Optional[str]) -> tuple[list[str], torch.Tensor]:
    names = sorted(os.listdir(path)) if path is not None else []
    sizes = {n: os.path.getsize(os.path.join(path, n)) for n in names}
    data = json.dumps(sizes).encode("utf-8")
    return names, torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _source(path: str, size: int) -> torch.Tensor:
    """The file's bytes as a tensor on its own pages (a private mapping: no copy)."""
    return torch.from_file(path, shared=False, size=size, dtype=torch.uint8)


def _target(path: str, size: int) -> torch.Tensor:
    """A new file of ``size`` bytes, its pages reserved, mapped shared as a tensor."""
    reserve(path, size)  # a full file system is an error here, not a SIGBUS later
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


def _open(into: str, step: int) -> str:
    staging = os.path.join(into, f".tmp-{step_name(step)}")
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    return staging


def _close(into: str, staging: str, step: int) -> str:
    final = os.path.join(into, step_name(step))
    shutil.rmtree(final, ignore_errors=True)
    os.rename(staging, final)
    return final


def exchange(group: Any, path: Optional[str], dst: int, src: int, into: str, step: int
             ) -> Optional[str]:
    """Send the snapshot ``path`` to ``dst`` while receiving ``src``'s as
    ``into/step-N``; returns the received directory. ``path`` None: this rank has no
    snapshot of ``step`` (dropped) and sends an empty header; one received is not kept."""
    import torch.distributed as dist

    names, header = _header(path)
    sizes_out = torch.tensor([header.numel()], dtype=torch.int64)
    size_in = torch.zeros(1, dtype=torch.int64)
    _wait([dist.isend(sizes_out, dst, group=group), dist.irecv(size_in, src, group=group)])
    got = torch.empty(int(size_in.item()), dtype=torch.uint8)
    _wait([dist.isend(header, dst, group=group), dist.irecv(got, src, group=group)])
    incoming = json.loads(got.numpy().tobytes().decode("utf-8"))
    staging = _open(into, step)
    requests = []
    for name in names:
        size = os.path.getsize(os.path.join(path, name))  # type: ignore[arg-type]
        if size:
            requests.append(dist.isend(_source(os.path.join(path, name), size), dst,  # type: ignore[arg-type]
                                       group=group))
    for name, size in sorted(incoming.items()):
        target = _target(os.path.join(staging, name), size)
        if size:
            requests.append(dist.irecv(target, src, group=group))
    _wait(requests)
    if not incoming:  # the sender dropped its snapshot of this step
        shutil.rmtree(staging, ignore_errors=True)
        return None
    return _close(into, staging, step)


def send(group: Any, path: str, dst: int) -> None:
    """Send the snapshot ``path`` to ``dst`` (blocking; resume: a replica going back to
    the rank whose node lost its own)."""
    import torch.distributed as dist

    names, header = _header(path)
    dist.send(torch.tensor([header.numel()], dtype=torch.int64), dst, group=group)
    dist.send(header, dst, group=group)
    for name in names:
        size = os.path.getsize(os.path.join(path, name))
        if size:
            dist.send(_source(os.path.join(path, name), size), dst, group=group)


def recv(group: Any, src: int, into: str, step: int) -> str:
    """Receive what :func:`send` sent as ``into/step-N``; returns that directory."""
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    got = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(got, src, group=group)
    incoming = json.loads(got.numpy().tobytes().decode("utf-8"))
    staging = _open(into, step)
    for name, nbytes in sorted(incoming.items()):
        target = _target(os.path.join(staging, name), nbytes)
        if nbytes:
            dist.recv(target, src, group=group)
    return _close(into, staging, step)


def _wait(requests: list[Any]) -> None:
    for request in requests:
        request.wait()
