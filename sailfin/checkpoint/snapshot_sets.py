"""A memory snapshot's buffer set: its files, its header, its checks, and the copy into
it (the state's layout as bytes: :mod:`.snapshot_layout`).

A set is three files in a rank's directory (:mod:`.snapshot_dirs`)::

    a.bin    this rank's share of the tensors one after another (64-byte aligned), written
             in place through a shared mapping whose pages are reserved up front (a write
             cannot fail)
    a.pt     the rest of the state (counters, data position, schedulers...), each tensor
             replaced by its place (which rank's .bin, where), and the rank's random
             streams: a pickle of plain values, read back by an unpickler that rebuilds no
             class but OrderedDict, set, torch.Size and dtypes
    a.json   the header: step, run, the manifest's facts, the sizes and CRC-32s below and
             its own CRC-32; renamed into place once the set holds its step
    a.next   the header staged (by the thread that copied the set) until that rename

What is checked on resume: the header's CRC-32; the ``.pt`` whole (size, CRC-32); the
``.bin``'s size, and a CRC-32 of the tensors copied at the step's end whole and of 4 KiB
of every MiB of those copied beside training (:func:`sample_crc`): found without a
second pass over the memory the copy wrote.
"""

from __future__ import annotations

import json
import os
import pickle
import queue
import stat
import threading
from concurrent.futures import Future
from typing import Any, Callable, NamedTuple, Optional

import torch

from ..compat.torch import register_host_memory, unregister_host_memory, version
from ..utils.crc import crc32
from .errors import CheckpointCorrupt
from .snapshot_dirs import remove_file
from .snapshot_layout import Layout, load_state

SETS = ("a", "b")
_BLOCK, _STRIDE = 4096, 1 << 20  # the sampled check: 4 KiB of every MiB


class Location(NamedTuple):
    """One buffer set: its directory and name (``a`` or ``b``)."""

    directory: str
    name: str

    def path(self, ext: str) -> str:
        return os.path.join(self.directory, f"{self.name}.{ext}")

    def __str__(self) -> str:
        return self.path("json")


def bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A storage's bytes as a flat uint8 tensor (its ``copy_`` releases the GIL)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def sample_crc(data: torch.Tensor, full: int) -> int:
    """CRC-32 of the first ``full`` bytes of ``data`` (uint8, CPU) and of 4 KiB of every
    MiB after them and the last 4 KiB: found without reading the copy again."""
    view = memoryview(data.numpy()) if data.numel() else memoryview(b"")
    crc = crc32(view[:full])
    for start in range(full, len(view), _STRIDE):
        crc = crc32(view[start:start + _BLOCK], crc)
    return crc32(view[max(full, len(view) - _BLOCK):], crc)


def header_crc(header: dict[str, Any]) -> int:
    """The CRC-32 a header read back must carry: of its JSON, keys sorted, without it."""
    return crc32(json.dumps({k: v for k, v in header.items() if k != "crc32"},
                            sort_keys=True).encode("utf-8"))


class Encoded(str):
    """A header value given as its JSON text already (keys sorted): the run's config,
    the same at every snapshot, is encoded once."""


def header_bytes(header: dict[str, Any]) -> bytes:
    """``header`` as its file holds it: one encoding, keys sorted, then ``crc32``, the
    CRC-32 of that text (what :func:`header_crc` finds again from the parsed header)."""
    given = {k: v for k, v in header.items() if isinstance(v, Encoded)}
    body = json.dumps({k: "\0" if k in given else v for k, v in header.items()
                       if k != "crc32"}, sort_keys=True)
    for key, text in given.items():  # a raw '"key": "' is never inside a JSON string
        hole = f'{json.dumps(key)}: "\\u0000"'
        if body.count(hole) != 1:  # a value that spells the hole too: encode it all
            return header_bytes({k: json.loads(v) if k in given else v
                                 for k, v in header.items()})
        body = body.replace(hole, f"{json.dumps(key)}: {text}")
    return f'{body[:-1]}{", " if len(body) > 2 else ""}"crc32": {crc32(body.encode())}}}'.encode()


def _read_regular(path: str, limit: Optional[int] = None) -> bytes:
    """A regular file's bytes (never a FIFO or device: no hang, no endless read)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or (limit is not None and info.st_size > limit):
            raise CheckpointCorrupt(f"memory snapshot file {path} is not a snapshot's file",
                                    path)
        with os.fdopen(os.dup(fd), "rb") as fh:
            return fh.read()
    finally:
        os.close(fd)


def read_header(where: Location) -> dict[str, Any]:
    """The set's header, its CRC-32 checked; CheckpointCorrupt if damaged or missing."""
    path = where.path("json")
    try:
        header = json.loads(_read_regular(path, limit=64 << 20))
    except FileNotFoundError:
        raise CheckpointCorrupt(f"memory snapshot {path} is missing", path) from None
    except (OSError, ValueError) as exc:
        raise CheckpointCorrupt(f"memory snapshot header {path} cannot be read ({exc})",
                                path) from None
    if not isinstance(header, dict) or header.get("crc32") != header_crc(header):
        raise CheckpointCorrupt(f"memory snapshot header {path} does not match its CRC-32: "
                                "it is damaged", path)
    return header


class Buffer:
    """One set's ``.bin``, mapped shared; registered with CUDA when a GPU copies into it."""

    def __init__(self, path: str) -> None:
        self.path, self.data, self.registered = path, torch.empty(0, dtype=torch.uint8), False
        self.made = False  # the file exists (an empty one too: the set holds no tensor)
        self.views: dict[str, Any] = {}  # the last layout's pairs

    def hold(self, nbytes: int, cuda: bool) -> None:
        if nbytes > self.data.numel() or not self.made:
            self.release()  # (and the old mapping's pairs)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:  # reserved now: a write into a mapped page of a full tmpfs is a SIGBUS
                if nbytes:
                    os.posix_fallocate(fd, 0, nbytes)
            except OSError:
                os.close(fd)
                remove_file(self.path)
                raise
            os.close(fd)
            self.data = (bytes_of(torch.UntypedStorage.from_file(
                self.path, shared=True, nbytes=nbytes), torch.device("cpu")) if nbytes
                else torch.empty(0, dtype=torch.uint8))
            self.made = True
        if cuda and not self.registered:
            self.registered = register_host_memory(self.data)

    def pairs(self, layout: Layout) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(place in the buffer, source bytes) per storage of ``layout``; made once per
        layout (a source's view holds its storage: no other takes its address meanwhile)."""
        if self.views.get("layout") is not layout:
            self.views = {"layout": layout, "pairs": [
                (self.data[offset:offset + key[2]],
                 bytes_of(tensor.untyped_storage(), tensor.device))
                for (key, tensor), offset in zip(layout.sources, layout.offsets)]}
        return self.views["pairs"]

    def release(self) -> None:
        if self.registered:
            unregister_host_memory(self.data)
        self.data, self.registered, self.views = torch.empty(0, dtype=torch.uint8), False, {}
        self.made = False


def read_bin(where: Location, header: dict[str, Any]) -> torch.Tensor:
    """The set's ``.bin`` (its tensors' bytes), checked against ``header``: its size and
    sampled CRC-32 (:func:`sample_crc`)."""
    total, full, sampled = header["memory_snapshot"]["tensors"]
    if os.path.getsize(where.path("bin")) < total:
        raise CheckpointCorrupt(f"memory snapshot {where.path('bin')} is shorter than its "
                                "header says: it is damaged", str(where))
    data = (torch.from_file(where.path("bin"), shared=False, size=total, dtype=torch.uint8)
            if total else torch.empty(0, dtype=torch.uint8))
    if sample_crc(data, full) != sampled:
        raise CheckpointCorrupt(f"memory snapshot {where.path('bin')} does not match its "
                                "sampled CRC-32 in the header: it is damaged", str(where))
    return data


def read_set(where: Location, header: dict[str, Any],
             other_part: Optional[Callable[[int], torch.Tensor]] = None) -> Any:
    """The state a set holds, checked against ``header``: its ``.pt`` whole (size and
    CRC-32) and its ``.bin`` (:func:`read_bin`); ``other_part(p)``: the checked bytes of
    part ``p`` (another rank's set of the same step) for the storages that rank copied."""
    shown = str(where)
    try:
        about = header["memory_snapshot"]
        size, crc = about["state"]
        blob = _read_regular(where.path("pt"), limit=size)
        if len(blob) != size or crc32(blob) != crc:
            raise CheckpointCorrupt(f"memory snapshot {where.path('pt')} does not match its "
                                    "CRC-32 in the header: it is damaged", shown)
        parts = {about["part"]: read_bin(where, header)}

        def part_bytes(part: int) -> torch.Tensor:
            if part not in parts:
                if other_part is None:
                    raise KeyError(f"part {part} (another rank's set)")
                parts[part] = other_part(part)
            return parts[part]

        return load_state(blob, part_bytes)
    except (OSError, KeyError, TypeError, ValueError, IndexError, RuntimeError, EOFError,
            AttributeError, pickle.UnpicklingError) as exc:
        raise CheckpointCorrupt(f"memory snapshot {shown} cannot be read ({exc}): it is "
                                "damaged", shown) from None


class Copy:
    """The copy left to run beside training: a thread's on the CPU, a side stream's on a
    GPU. :meth:`before_step` comes before the next optimizer step."""

    def __init__(self, worker: Worker, pairs: list, tensors: list,
                 streams: dict, cuda: bool = True) -> None:
        # The tensors themselves (a byte view of a storage has a version counter of its own).
        self.versions = [(tensor, version(tensor)) for tensor in tensors]
        gpu = [(d, s) for d, s in pairs if s.is_cuda] if cuda else []  # cuda: any on a GPU
        cpu = [(d, s) for d, s in pairs if not s.is_cuda] if cuda else pairs
        self.events = []
        for device in {s.device for _, s in gpu}:
            stream = streams.get(device) or streams.setdefault(device, torch.cuda.Stream(device))
            stream.wait_stream(torch.cuda.current_stream(device))  # after the optimizer step
            with torch.cuda.stream(stream):
                for d, s in gpu:
                    if s.device == device:
                        d.copy_(s, non_blocking=True)
                        s.record_stream(stream)  # not reused while the copy reads it
            event = torch.cuda.Event()
            event.record(stream)
            self.events.append((device, event))
        self.future = worker.submit(_copy_all, cpu) if cpu else None

    def before_step(self) -> bool:
        """The optimizer step may change the sources after this; True when none changed
        since the snapshot was taken (a forward that renormalises weights in place did)."""
        self.busy = self.future is not None and not self.future.done()  # training waits
        if self.future is not None:
            self.future.result()
        for device, event in self.events:  # the step's kernels wait, not this thread
            torch.cuda.current_stream(device).wait_event(event)
        return all(version(source) == seen for source, seen in self.versions)

    def done(self) -> None:
        for _, event in self.events:
            event.synchronize()


class Worker:
    """One thread for background work, in order. It leaves when stopped, or once idle for
    a second (a run that failed leaves no thread behind), and comes back with the next
    job. Not a daemon: it never dies inside torch at the interpreter's exit."""

    def __init__(self, name: str) -> None:
        self.name, self._jobs, self._lock = name, queue.SimpleQueue(), threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def submit(self, fn: Optional[Callable[..., Any]], *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            self._jobs.put((future, fn, args))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name)
                self._thread.start()
        return future

    def stop(self) -> None:
        """End the thread once the jobs before this are done."""
        thread = self._thread
        if thread is not None:
            self.submit(None)
            thread.join()

    def _run(self) -> None:
        while True:
            try:
                future, fn, args = self._jobs.get(timeout=1.0)
            except queue.Empty:
                fn = None
            with self._lock:
                if fn is None and self._jobs.empty():
                    self._thread = None
                    return
            if fn is not None and future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - the waiter raises it
                    future.set_exception(exc)


def _copy_all(pairs: list) -> None:
    for destination, source in pairs:
        destination.copy_(source)


