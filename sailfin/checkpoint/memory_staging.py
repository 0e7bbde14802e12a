"""Staging buffers for memory snapshots: the state copied into files mapped shared.

One file per storage in ``staging-rank<r>/``, reused from snapshot to snapshot; the
writer process (:mod:`.memory_writer`) maps the same files, told only each tensor's
place in them and the state's other values.

Example::

    staging = SharedStaging("/dev/shm/sailfin-run-node0/staging-rank00000")
    described, copying = staging.stage({"model": model.state_dict()}, later=keys)
    ...                                   # the next forward and backward run
    assert copying.finish()               # before the optimizer step
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import torch

from ..compat.torch import version


class _Slot:
    """Where a tensor's storage is in the staging files (what crosses the pipe)."""

    def __init__(self, name: str, nbytes: int, dtype: torch.dtype, size: tuple,
                 stride: tuple, offset: int) -> None:
        self.name, self.nbytes, self.dtype = name, nbytes, dtype
        self.size, self.stride, self.offset = size, stride, offset


class SharedStaging:
    """Staging buffers as files mapped shared in ``directory``, reused while a storage
    keeps its address, device and size (parameters and optimizer state updated in
    place): a snapshot costs one memory copy and no allocation."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._buffers: dict[tuple[int, str, int], tuple[str, torch.UntypedStorage]] = {}
        # (buffer, source) as flat uint8 tensors, per storage copied by the thread: made
        # once, not at every snapshot. The source's view holds its storage, so no other
        # storage can take that address while the entry lives.
        self._views: dict[tuple[int, str, int], tuple[str, torch.Tensor, torch.Tensor]] = {}
        self._count = 0
        self._copier: Optional[ThreadPoolExecutor] = None
        self.kept = False  # the last stage() kept a value of another type as it was

    def stage(self, obj: Any, later: frozenset = frozenset()
              ) -> tuple[Any, Optional["PendingCopy"]]:
        """``obj`` with every tensor replaced by its slot in the staging files: copied now,
        but for the storages whose ``(data_ptr, device)`` is in ``later``, which a thread
        copies while training goes on (the :class:`PendingCopy`; None if none). The
        result's containers are new; :attr:`kept` says whether it also holds values of
        other types as they are (a set, a NumPy array: possibly changed later)."""
        sources: dict[tuple[int, str, int], torch.Tensor] = {}
        slots: dict[tuple[int, str, int], list[_Slot]] = {}

        def stage(value: torch.Tensor) -> Any:
            value = value.detach()  # shares the version counter: a change is seen
            if value.layout is not torch.strided or value.is_quantized:
                return value.to("cpu", copy=True)  # rare: pickled as it is
            storage = value.untyped_storage()
            slot = _Slot("", storage.nbytes(), value.dtype, tuple(value.size()),
                         tuple(value.stride()), value.storage_offset())
            if slot.nbytes:  # else an empty tensor (an fsdp rank's share of a small one)
                key = (storage.data_ptr(), str(value.device), slot.nbytes)
                sources.setdefault(key, value)
                slots.setdefault(key, []).append(slot)
            return slot

        kept: list = []
        staged = _walk(obj, stage, kept)
        self.kept = bool(kept)
        # A storage not seen before takes the buffer of one gone since the last snapshot,
        # if of its size (the random streams are new tensors each time): no allocation.
        spare: dict[int, list[tuple[str, torch.UntypedStorage]]] = {}
        for key, buffer in self._buffers.items():
            if key not in sources:
                spare.setdefault(key[2], []).append(buffer)
        used: dict[tuple[int, str, int], tuple[str, torch.UntypedStorage]] = {}
        views: dict[tuple[int, str, int], tuple[str, torch.Tensor, torch.Tensor]] = {}
        deferred: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for key, value in sources.items():
            found = self._buffers.get(key)
            if found is None:
                same_size = spare.get(key[2])
                found = same_size.pop() if same_size else self._allocate(key[2])
            used[key] = found
            for slot in slots[key]:
                slot.name = found[0]
            if key[:2] in later:
                view = self._views.get(key)
                if view is None or view[0] != found[0]:
                    view = (found[0], _bytes_of(found[1], torch.device("cpu")),
                            _bytes_of(value.untyped_storage(), value.device))
                views[key] = view
                deferred.append((view[1], view[2], value))
            else:
                found[1].copy_(value.untyped_storage())
        for buffers in spare.values():
            for name, _ in buffers:  # storages gone since the last snapshot
                remove_file(os.path.join(self.directory, name))
        self._buffers, self._views = used, views
        if not deferred:
            return staged, None
        if self._copier is None:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="sailfin-snapshot-copy")
        return staged, PendingCopy(self._copier, deferred)

    def _allocate(self, nbytes: int) -> tuple[str, torch.UntypedStorage]:
        os.makedirs(self.directory, exist_ok=True)
        self._count += 1
        name = f"{self._count:08d}.bin"
        path = os.path.join(self.directory, name)
        # Reserve the pages now: a write into a mapped page of a full tmpfs is a SIGBUS;
        # a reservation that does not fit is an OSError (ENOSPC) here instead.
        try:
            reserve(path, nbytes)
        except OSError:
            remove_file(path)
            raise
        return name, torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)

    def release(self) -> None:
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None
        self._buffers, self._views = {}, {}
        shutil.rmtree(self.directory, ignore_errors=True)


class PendingCopy:
    """Storages being copied into their staging buffers by a thread, while the next
    forward and backward run (a tensor's ``copy_`` leaves the interpreter to them).
    :meth:`finish` must be called before the next optimizer step: then only a change
    nobody expects (a forward that renormalises its weights in place) makes it False."""

    def __init__(self, executor: ThreadPoolExecutor,
                 copies: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        # (buffer's bytes, source storage's bytes, source tensor whose version is checked)
        self._versions = [(source, version(source)) for _, _, source in copies]
        pairs = [(buffer, source) for buffer, source, _ in copies]
        self._future = executor.submit(_copy_all, pairs)

    def wait(self) -> None:
        self._future.result()

    def finish(self) -> bool:
        """Wait for the copy; True when no source changed since the snapshot was taken."""
        self.wait()
        return all(version(source) == seen for source, seen in self._versions)


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """The storage's bytes as a flat uint8 tensor: its ``copy_`` releases the GIL."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for destination, source in pairs:
        destination.copy_(source)


def reserve(path: str, nbytes: int) -> None:
    """Create ``path`` with ``nbytes`` bytes, pages reserved where the platform can:
    writing them through a mapping cannot fail."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        if nbytes and hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
        else:
            os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


def remove_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


_SCALARS = frozenset({int, float, bool, str, bytes, type(None)})


def _walk(obj: Any, fn: Any, kept: Optional[list] = None, leaf: type = torch.Tensor) -> Any:
    """``obj`` with ``fn(x)`` for each ``leaf`` ``x``; dicts, lists and tuples copied,
    scalars in them kept, any other value kept and appended to ``kept``. On the step's path:
    scalars are not visited by a call each, and a sequence of scalars (Python's random
    state: 625 ints) is recognised in C."""
    if isinstance(obj, leaf):
        return fn(obj)
    if isinstance(obj, dict):
        out = {k: v if type(v) in _SCALARS else _walk(v, fn, kept, leaf)
               for k, v in obj.items()}
        return OrderedDict(out) if isinstance(obj, OrderedDict) else out
    if type(obj) in (list, tuple):
        if _SCALARS.issuperset(map(type, obj)):
            return obj if type(obj) is tuple else list(obj)
        return type(obj)(v if type(v) in _SCALARS else _walk(v, fn, kept, leaf) for v in obj)
    if kept is not None:
        kept.append(obj)
    return obj


def rebuild(obj: Any, directory: str, mapped: dict[str, torch.UntypedStorage],
            used: Optional[dict[str, torch.UntypedStorage]] = None) -> Any:
    """The writer's side: each slot back as a tensor on its mapped staging file
    (``mapped``: file name -> mapping, added to; ``used``: the ones ``obj`` names)."""
    used = {} if used is None else used

    def tensor(slot: _Slot) -> torch.Tensor:
        if slot.nbytes == 0:
            return torch.empty_strided(slot.size, slot.stride, dtype=slot.dtype)
        storage = mapped.get(slot.name)
        if storage is None or storage.nbytes() != slot.nbytes:
            storage = mapped[slot.name] = torch.UntypedStorage.from_file(
                os.path.join(directory, slot.name), shared=True, nbytes=slot.nbytes)
        used[slot.name] = storage
        out = torch.empty(0, dtype=slot.dtype)
        out.set_(storage, slot.offset, slot.size, slot.stride)
        return out

    return _walk(obj, tensor, leaf=_Slot)

