"""The process that writes memory snapshots, out of the training process.

Serialising a snapshot and computing its CRC-32s in a thread of the training
process competes with training for the interpreter and the cores. So the step
copies the state into staging buffers that are files in the node's snapshot
directory, mapped shared (``staging-rank<r>/``, one file per storage, reused
from snapshot to snapshot); a writer process started once per rank maps the
same files and writes the snapshot's files, manifest and all, under the
temporary name, then renames it. Only a small description of the state (the
tensors' places in the buffers, and the state's other values) crosses the pipe.

The writer stops when the training process closes it or dies (its pipe ends);
one that finds the training process gone before the rename leaves the
snapshot unfinished, never complete.

Example::

    staging = SharedStaging("/dev/shm/sailfin-run-node0/staging-rank00000")
    described = staging.copy({"model": model.state_dict()})   # on the step's path
    writer = WriterProcess()
    writer.write(directory, "step-00000012", described, facts, rank_file)
    writer.close(); staging.release()
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from collections import OrderedDict
from typing import Any, Optional

import torch

from . import manifest as manifests
from .serialize import FileEntry, save_object
from .storage import LocalStorage

_ALIGN = 64


class _Slot:
    """Where a tensor's storage is in the staging files (what crosses the pipe)."""

    def __init__(self, name: str, nbytes: int, dtype: torch.dtype, size: tuple,
                 stride: tuple, offset: int) -> None:
        self.name, self.nbytes, self.dtype = name, nbytes, dtype
        self.size, self.stride, self.offset = size, stride, offset


class SharedStaging:
    """Staging buffers as files mapped shared in ``directory``, reused while a storage
    keeps its address, device and size (parameters and optimizer state updated in
    place): a snapshot costs the step one memory copy and no allocation."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._buffers: dict[tuple[int, str, int], tuple[str, torch.UntypedStorage]] = {}
        self._count = 0

    def nbytes(self) -> int:
        return sum(buf.nbytes() for _, buf in self._buffers.values())

    def copy(self, obj: Any) -> Any:
        """``obj`` with every tensor copied into a staging file and replaced by its slot."""
        used: dict[tuple[int, str, int], tuple[str, torch.UntypedStorage]] = {}

        def stage(value: torch.Tensor) -> Any:
            value = value.detach()
            if value.layout is not torch.strided or value.is_quantized:
                return value.to("cpu", copy=True)  # rare: pickled as it is
            storage = value.untyped_storage()
            if storage.nbytes() == 0:  # an empty tensor (an fsdp rank's share of a small one)
                return _Slot("", 0, value.dtype, tuple(value.size()), tuple(value.stride()), 0)
            key = (storage.data_ptr(), str(value.device), storage.nbytes())
            if key not in used:
                found = self._buffers.get(key)
                if found is None:
                    found = self._allocate(storage.nbytes())
                found[1].copy_(storage)
                used[key] = found
            return _Slot(used[key][0], storage.nbytes(), value.dtype, tuple(value.size()),
                         tuple(value.stride()), value.storage_offset())

        staged = _walk(obj, stage)
        for key, (name, _) in self._buffers.items():
            if key not in used:  # a storage gone since the last snapshot
                _remove(os.path.join(self.directory, name))
        self._buffers = used
        return staged

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
            _remove(path)
            raise
        return name, torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)

    def release(self) -> None:
        self._buffers = {}
        shutil.rmtree(self.directory, ignore_errors=True)


def reserve(path: str, nbytes: int) -> None:
    """Create ``path`` with ``nbytes`` bytes whose pages are reserved (where the platform
    can: Linux, where /dev/shm is), so that writing them through a mapping cannot fail."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        if nbytes and hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
        else:
            os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _walk(obj: Any, fn: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        out = {k: _walk(v, fn) for k, v in obj.items()}
        return OrderedDict(out) if isinstance(obj, OrderedDict) else out
    if type(obj) in (list, tuple):
        return type(obj)(_walk(v, fn) for v in obj)
    return obj


def _rebuild(obj: Any, directory: str, mapped: dict[str, torch.UntypedStorage]) -> Any:
    """The writer's side: each slot back as a tensor on the mapped staging file."""
    def tensor(slot: Any) -> Any:
        if not isinstance(slot, _Slot):
            return slot
        if slot.nbytes == 0:
            return torch.empty_strided(slot.size, slot.stride, dtype=slot.dtype)
        storage = mapped.get(slot.name)
        if storage is None:
            storage = mapped[slot.name] = torch.UntypedStorage.from_file(
                os.path.join(directory, slot.name), shared=True, nbytes=slot.nbytes)
        out = torch.empty(0, dtype=slot.dtype)
        out.set_(storage, slot.offset, slot.size, slot.stride)
        return out

    if isinstance(obj, _Slot):
        return tensor(obj)
    if isinstance(obj, dict):
        out = {k: _rebuild(v, directory, mapped) for k, v in obj.items()}
        return OrderedDict(out) if isinstance(obj, OrderedDict) else out
    if type(obj) in (list, tuple):
        return type(obj)(_rebuild(v, directory, mapped) for v in obj)
    return obj


def write_snapshot(directory: str, name: str, staged: dict[str, Any], facts: dict[str, Any],
                   staging_dir: str, parent: Optional[int] = None) -> None:
    """Write ``staged`` (stem -> state described by :class:`SharedStaging`) as the snapshot
    ``directory/name``: the files under ``.tmp-<name>``, the manifest last, then the
    rename (not when the training process ``parent`` is gone meanwhile)."""
    storage = LocalStorage()
    temporary = os.path.join(directory, f".tmp-{name}")
    shutil.rmtree(temporary, ignore_errors=True)
    os.makedirs(temporary)
    mapped: dict[str, torch.UntypedStorage] = {}
    files: dict[str, FileEntry] = {}
    for stem, described in staged.items():
        obj = _rebuild(described, staging_dir, mapped)
        files[f"{stem}.pt"] = save_object(storage, os.path.join(temporary, f"{stem}.pt"), obj)
    with open(os.path.join(temporary, manifests.MANIFEST), "wb") as fh:
        fh.write(manifests.encode(facts, files))
    if parent is not None and os.getppid() != parent:
        return  # the training process died: its last snapshot stays unfinished
    final = os.path.join(directory, name)
    shutil.rmtree(final, ignore_errors=True)  # a snapshot of this step from before a restart
    os.rename(temporary, final)


def _serve(parent: int) -> None:
    """The writer process: one snapshot per message on stdin until ``None`` or the pipe
    ends; each answered on stdout (None, or the error's errno and reason)."""
    torch.set_num_threads(1)
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print must not land among the replies
    jobs = sys.stdin.buffer
    pickle.dump("ready", replies)  # torch is imported: snapshots can come
    replies.flush()
    while True:
        try:
            job = pickle.load(jobs)
        except (EOFError, OSError):
            return  # the training process is gone
        if job is None:
            return
        try:
            write_snapshot(*job, parent=parent)
            reply: Any = None
        except BaseException as exc:  # noqa: BLE001 - sent back, raised in the trainer
            reply = (_errno(exc), f"{type(exc).__name__}: {exc}")
        pickle.dump(reply, replies)
        replies.flush()


def _errno(exc: Optional[BaseException]) -> Optional[int]:
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc.errno
        exc = exc.__cause__
    return None


class WriterProcess:
    """A process that writes this rank's snapshots (started at the first one)."""

    def __init__(self) -> None:
        self._proc: Any = None
        self._ready = False

    def write(self, directory: str, name: str, staged: dict[str, Any], facts: dict[str, Any],
              staging_dir: str) -> None:
        """Have the writer write the snapshot; block until it is renamed (the calling
        thread waits on a pipe, holding nothing). Raises OSError (errno kept: a full
        file system) or RuntimeError with the writer's reason."""
        self.ready()
        try:
            pickle.dump((directory, name, staged, facts, staging_dir), self._proc.stdin)
            self._proc.stdin.flush()
            reply = pickle.load(self._proc.stdout)
        except (EOFError, OSError):
            raise RuntimeError("the memory snapshot writer process died") from None
        if reply is not None:
            code, reason = reply
            if code is not None:
                raise OSError(code, f"memory snapshot writer: {reason}")
            raise RuntimeError(f"memory snapshot writer: {reason}")

    def ready(self) -> None:
        """Start the writer if it is not running, and wait until it can write (its
        interpreter and torch imported: a second or so, once per run)."""
        if self._proc is not None and self._proc.poll() is None and self._ready:
            return
        if self._proc is None or self._proc.poll() is not None:
            self.start()
        try:
            hello = pickle.load(self._proc.stdout)
        except (EOFError, OSError):
            hello = None
        if hello != "ready":
            raise RuntimeError("the memory snapshot writer process did not start (exit code "
                               f"{self._proc.poll()}); its error is above")
        self._ready = True

    def start(self) -> None:
        """Start the writer without waiting (it imports torch while the run sets up)."""
        if self._proc is not None and self._proc.poll() is None:
            return
        self._ready = False
        self._launch()

    def _launch(self) -> None:
        # A fresh interpreter (not fork: the training process has threads), importing
        # this sailfin; it needs no more than one thread.
        package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(
                   [package] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from sailfin.checkpoint.memory_writer import "
             "_serve; _serve(int(sys.argv[1]))", str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)

    def close(self) -> None:
        """Stop the writer (after the snapshot it is writing)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            pickle.dump(None, proc.stdin)
            proc.stdin.close()
        except (OSError, ValueError):
            pass
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


__all__ = ["SharedStaging", "WriterProcess", "write_snapshot"]
