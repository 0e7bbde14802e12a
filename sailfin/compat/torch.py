"""sailfin's uses of torch's private attributes, each beside its public alternative or
the upstream issue that would give one: a torch release may drop any of them without a
deprecation, and :func:`missing` (``tests/test_compat.py``) names those it lacks.

Example::

    found = found_inf_per_device(scaler, optimizer)   # after scaler.step(optimizer)
    stepped = not any(bool(v.item()) for v in found.values())
"""

from __future__ import annotations

import contextlib
import os
import pickle
import pkgutil
from typing import Any, Callable, Iterator, Optional

import torch

from ..utils.crc import crc32

PRIVATE = (
    "torch.amp.GradScaler._found_inf_per_device",
    "torch.distributed.checkpoint._fsspec_filesystem.FsspecWriter",
    "torch.distributed.checkpoint._fsspec_filesystem.FsspecReader",
    "torch.Tensor._version",
    "torch._foreach_lerp_",
    "torch.distributed.distributed_c10d._get_default_store",
    "torch._dynamo.exc.TorchDynamoException",
    "torch.distributed.tensor._utils.compute_local_shape_and_global_offset",
    "torch.distributed.checkpoint._traverse.set_element",
)
"""The dotted names sailfin reads; :func:`missing` checks each."""


def found_inf_per_device(scaler: "torch.amp.GradScaler", optimizer: torch.optim.Optimizer
                         ) -> dict[Any, torch.Tensor]:
    """Device -> the inf/NaN flag that ``scaler.step(optimizer)`` read: whether it skipped
    the optimizer's step. Read after ``step()`` and before ``update()``.

    Private: ``GradScaler._found_inf_per_device``. Public alternative: compare
    ``scaler.get_scale()`` before and after ``scaler.update()`` (a skipped step backs the
    scale off), which costs a host sync of its own and answers only after ``update()``.
    Upstream: pytorch/pytorch#67590 asks for the scaler to say whether it stepped.
    """
    return scaler._found_inf_per_device(optimizer)


def version(tensor: torch.Tensor) -> int:
    """How many in-place changes ``tensor``'s data has had: autograd's version counter,
    shared by its views and ``detach()`` (not by ``.data``). A memory snapshot copies
    the parameters while the next forward runs and compares this before and after, so a
    forward that changes them in place (``nn.Embedding(max_norm=...)``) is noticed.

    Private: ``Tensor._version``, the counter autograd's in-place checks read (the
    "modified by an inplace operation" error quotes it). Public alternative: none that
    sees an in-place change without comparing the data itself.
    """
    return tensor._version


def register_host_memory(tensor: torch.Tensor) -> bool:
    """Register ``tensor``'s host memory (a memory snapshot's mapped file) with CUDA as
    pinned, so that a device-to-host copy into it runs on the copy engine while the GPU
    computes; False where CUDA or the driver cannot (the copy is then a staged one).

    Public alternative: ``tensor.pin_memory()`` allocates new pinned memory, but a
    snapshot's buffer must be the file itself. Uses ``torch.cuda.cudart()`` (documented,
    but a thin binding of the CUDA runtime: ``cudaHostRegister``); no private attribute.
    """
    if not torch.cuda.is_available() or tensor.numel() == 0:
        return False
    try:
        error = torch.cuda.cudart().cudaHostRegister(
            tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
    except (AttributeError, RuntimeError, TypeError):
        return False
    return int(getattr(error, "value", error)) == 0


def unregister_host_memory(tensor: torch.Tensor) -> None:
    """Undo :func:`register_host_memory` (before the memory is unmapped)."""
    try:
        torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
    except (AttributeError, RuntimeError, TypeError):
        pass


def lerp_all_(ends: list[torch.Tensor], targets: list[torch.Tensor], weight: float) -> None:
    """``end += weight * (target - end)`` for each pair, in one fused op (the weight
    average's update: one kernel for every parameter, not one per parameter).

    Private: ``torch._foreach_lerp_``, which ``torch.optim``'s foreach paths and
    ``torch.optim.swa_utils.get_ema_multi_avg_fn`` use. Public alternative:
    ``torch.lerp`` in a loop, one launch per parameter.
    """
    torch._foreach_lerp_(ends, targets, weight)


def default_store() -> Any:
    """The key-value store of the default process group (the rendezvous's store).

    Private: ``torch.distributed.distributed_c10d._get_default_store``. Public
    alternative: a ``TCPStore`` of one's own on another port, a second rendezvous.
    """
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def compiler_error() -> type:
    """The base class of the errors ``torch.compile`` raises while it traces or compiles.

    Private module: ``torch._dynamo.exc`` (``TorchDynamoException``); ``torch.compiler``
    names no error class. Imported when called: ``torch._dynamo`` is slow to import.
    """
    from torch._dynamo.exc import TorchDynamoException

    return TorchDynamoException


def local_shape_and_offset(tensor: Any) -> tuple[Any, Any]:
    """(shape, offset) of the block of the full tensor a DTensor holds on this rank.

    Private module: ``torch.distributed.tensor._utils``; DTensor has no public call that
    gives the global offset of its local block (``init_from`` reads exactly that block).
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,
                                                 tensor.placements)


def fsspec_writer() -> type:
    """DCP's storage writer for fsspec URLs (``s3://``, ``gs://``, ...).

    Private module: ``torch.distributed.checkpoint._fsspec_filesystem``. Upstream:
    pytorch/pytorch#188772 (make ``FsspecWriter``/``FsspecReader`` public); until then
    ``dcp.save(checkpoint_id=url)`` picks it itself, but takes no storage options.
    Imported when called: ``torch.distributed.checkpoint`` takes a second to import.
    """
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter


def fsspec_reader() -> type:
    """DCP's storage reader for fsspec URLs; private as :func:`fsspec_writer` says."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader


# What DCP's ``.metadata`` pickle names, and nothing else: its metadata classes, the
# storage record of its file system writer, torch's Size, dtypes and layouts, and a path.
# Reading it with ``pickle.load`` (as torch does) would run whatever a forged one names.
_METADATA_NAMES = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a name -> torch.layout lookup
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                          "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
}
_METADATA_NAMES["pathlib._local"] = _METADATA_NAMES["pathlib"]  # where Python 3.13 keeps them


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = name in _METADATA_NAMES.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        if not allowed:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP's metadata "
                                         "never holds")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent reference")


def read_dcp_metadata(stream: Any) -> Any:
    """DCP's ``.metadata`` from ``stream``, unpickled with only DCP's metadata classes and
    plain types allowed (torch's own reader calls ``pickle.load``: a forged file would
    run code). Raises :class:`pickle.UnpicklingError` for anything else.

    Private: the names allowed include ``_StorageInfo``, ``_MEM_FORMAT_ENCODING`` and
    ``torch.serialization._get_layout``, which torch's metadata pickle names. Public
    alternative: none; upstream DCP reads ``.metadata`` with ``pickle.load``.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    metadata = _MetadataUnpickler(stream).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def dcp_load(state: dict[str, Any], reader: Any, local: bool = False,
             check: Optional[Callable[[str, Any], None]] = None) -> None:
    """``dcp.load`` of ``state`` from ``reader``, with every non-tensor entry read by
    ``torch.load(weights_only=True)`` (DCP's default planner reads them with
    ``weights_only=False``), after ``check(key, bytes)`` where given. ``local``: this
    process alone, no collective. ``no_dist`` is passed only then: without a process
    group every release infers it.

    Private: ``torch.distributed.checkpoint._traverse.set_element``, which DCP's default
    planner uses to put a value at its place in a nested state dict. Public alternative:
    none (a planner that reads bytes itself must place them).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._traverse import set_element

    class WeightsOnlyPlanner(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            fqn = read_item.dest_index.fqn
            if check is not None:
                check(fqn, value)
            obj = torch.load(value, map_location="cpu", weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    # Without a process group every release loads alone (torch 2.6 has no ``no_dist``).
    alone = {"no_dist": True} if local and dist.is_initialized() else {}
    dcp.load(state, storage_reader=reader, planner=WeightsOnlyPlanner(), **alone)


def cpu_stager(pinned: bool) -> Any:
    """DCP's stager that copies a state dict to CPU memory (``pinned``: page-locked, for a
    GPU's copies), on the calling thread: ``DefaultStager`` (torch 2.9+), else the
    ``BlockingAsyncStager`` torch 2.6 has (pinned memory only when it caches its copy)."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        return BlockingAsyncStager(cache_staged_state_dict=pinned)
    return DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=False))


def streams_flushable_after_close(writer: Any, checksums: Optional[dict] = None) -> Any:
    """``writer`` (a DCP ``FileSystemWriter`` or ``FsspecWriter``), whose file streams
    take a ``flush()`` after ``close()`` as done (nothing left to write), and returns it.
    ``checksums``: filled with the (size, CRC-32) of each file the writer writes, by name,
    from the bytes as they pass (DCP writes each file front to back), so that nobody
    reads the files back to checksum them.

    Why: DCP wraps each file it writes in a ``NoCloseWriter`` (a local class of
    ``_StorageWriterTransforms.transform_save_stream``) whose ``close()`` flushes the file
    and never marks itself closed, so the garbage collector calls it again. After a
    failed write (a full disk) the failing frame keeps it alive until the file itself is
    closed; that second flush then raises, and Python 3.13 prints it ("Exception ignored
    in: <...NoCloseWriter...> ValueError: flush of closed file") under the one line the
    save's error already is. Private: the writer's ``fs`` attribute (its file system, set
    in ``__init__``; an instance attribute, so :func:`missing` cannot look it up).
    Public alternative: none; upstream, ``NoCloseWriter.close`` could skip a closed file.
    """
    writer.fs = _FlushAfterCloseFileSystem(writer.fs, checksums)
    return writer


class _FlushAfterCloseFileSystem:
    """A DCP file system whose written streams take a flush after close (see above)."""

    def __init__(self, fs: Any, checksums: Optional[dict] = None) -> None:
        self._fs, self._checksums = fs, checksums

    def __getattr__(self, name: str) -> Any:  # rename, mkdir, exists...: the file system's
        if name.startswith("_"):  # (a copy being unpickled has no _fs yet)
            raise AttributeError(name)
        return getattr(self._fs, name)

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with self._fs.create_stream(path, mode) as stream:
            if "r" in mode:
                yield stream
                return
            written = _FlushAfterClose(stream, self._checksums is not None)
            yield written
        if self._checksums is not None and written._whole:
            self._checksums[os.path.basename(str(path))] = (written._size, written._crc)


class _FlushAfterClose:
    """A written file whose ``flush()`` once closed does nothing; all else is the file's.
    ``count``: its size and CRC-32, from the bytes as they pass (a seek: not known)."""

    def __init__(self, stream: Any, count: bool = False) -> None:
        self._stream = stream
        self._size = self._crc = 0
        self._whole = count
        if not count:
            self.write = stream.write  # the hot path: no lookup through __getattr__

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self._stream.write(view)
        if written != len(view):  # a raw stream's short write: DCP's own loop goes on
            self._whole = False
        self._size += len(view)
        self._crc = crc32(view, self._crc)
        return written

    def seek(self, *args: Any) -> int:
        self._whole = False
        return self._stream.seek(*args)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._stream, name)

    def flush(self) -> None:
        if not self._stream.closed:
            self._stream.flush()


def missing() -> list[str]:
    """The names in :data:`PRIVATE` the installed torch lacks (empty: all present)."""
    out = []
    for name in PRIVATE:
        try:
            pkgutil.resolve_name(name)  # the longest importable module, then attributes
        except (ImportError, AttributeError):
            out.append(name)
    return out
