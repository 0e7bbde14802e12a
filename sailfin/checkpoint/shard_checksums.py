"""Checksums of a sharded checkpoint's files: computed by the rank that wrote each file,
listed in the manifest, checked before a resume uses the checkpoint.

Each rank checksums the files it writes (counted as the bytes pass, where the writer
was given a table for it: :func:`sailfin.compat.torch.streams_flushable_after_close`;
else read back from the page cache) and the figures travel to rank 0 with DCP's own
write results. On load the files are split
among the ranks; a damaged one raises :class:`CheckpointCorrupt` naming it, and
``resume: auto`` falls back to the next older checkpoint.

Example::

    writer = checksummed_writer(dcp.FileSystemWriter, path, single_file_per_rank=True)
    dcp.save(state, storage_writer=writer)
    writer.sailfin_checksums     # rank 0: {"__0_0.distcp": (size, crc), ".metadata": ...}
    writer.sailfin_entries       # rank 0: {"trainer": (size, crc, file), ...}: BytesIO entries
"""

from __future__ import annotations

import contextlib
import functools
import io
from typing import Any, Callable, Optional

from ..compat.torch import read_dcp_metadata
from ..utils.crc import crc32
from .errors import CheckpointCorrupt, CheckpointError
from .serialize import checksum_stream, open_checked, plain_shard_name
from .storage import Storage

# A write result that carries a rank's checksums to rank 0, never into DCP's index.
_CARRIER = "__sailfin_checksums__"

#: The one checksum of every file sailfin writes (zlib's CRC-32, from ISA-L where installed).
#: Nothing a machine happens to have installed changes it: a checkpoint saved on one
#: machine is checked the same way on any other.
ALGORITHM = "crc32"


def checksummed_writer(base: type, *args: Any, **kwargs: Any) -> Any:
    """A DCP writer of class ``base`` (``FileSystemWriter``, ``FsspecWriter``) built with
    ``args``, that checksums its files; after a save, rank 0's ``sailfin_checksums``
    holds every file's (size, checksum)."""
    return _checksummed(base)(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _checksummed(base: type) -> type:
    return type(f"Checksummed{base.__name__}", (_ChecksumMixin, base), {})


class _ChecksumMixin:
    """Adds to DCP's writer: each rank checksums what it wrote (its files, and each entry
    given as a ``BytesIO``: sailfin's small state); rank 0 collects them."""

    fs: Any
    path: Any
    sailfin_checksums: dict[str, tuple[int, int]] = {}
    sailfin_entries: dict[str, tuple[int, int, str]] = {}
    refusal: str = ""  # set: this rank refuses to write (the save fails on every rank)
    sailfin_written: Optional[dict] = None  # (size, CRC-32) by file name, counted as written

    def _checksum(self, relative: str) -> tuple[int, int]:
        known = self.sailfin_written.pop(relative, None) if self.sailfin_written else None
        if known is not None:  # counted while DCP wrote it: no second read
            return known
        with self.fs.create_stream(self.fs.concat_path(self.path, relative), "rb") as stream:
            return checksum_stream(stream)

    def write_data(self, plan: Any, planner: Any) -> Any:
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner import WriteItemType
        from torch.distributed.checkpoint.storage import WriteResult
        from torch.futures import Future

        if self.refusal:
            raise CheckpointError(self.refusal)
        entries = {}
        for item in plan.items:
            value = (planner.lookup_object(item.index) if item.type == WriteItemType.BYTE_IO
                     else None)
            if isinstance(value, io.BytesIO):
                view = value.getbuffer()
                entries[item.index.fqn] = (len(view), crc32(view))
                del view  # a live view would pin the buffer's size
        results = super().write_data(plan, planner).wait()  # type: ignore[misc]
        for r in results:  # which file holds each entry: its errors name it
            if r.index.fqn in entries:
                entries[r.index.fqn] += (r.storage_data.relative_path,)
        files = sorted({r.storage_data.relative_path for r in results})
        sums = {name: self._checksum(name) for name in files}  # this rank wrote them
        carrier = WriteResult(index=MetadataIndex(_CARRIER), size_in_bytes=0,
                              storage_data=(sums, entries))
        done: Future = Future()
        done.set_result([*results, carrier])
        return done

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        sums: dict[str, tuple[int, int]] = {}
        entries: dict[str, tuple[int, int, str]] = {}
        kept = []
        for rank_results in results:
            for result in rank_results:
                if result.index.fqn == _CARRIER:
                    sums.update(result.storage_data[0])
                    entries.update(result.storage_data[1])
            kept.append([r for r in rank_results if r.index.fqn != _CARRIER])
        super().finish(metadata, kept)  # type: ignore[misc]
        sums[".metadata"] = self._checksum(".metadata")  # rank 0 wrote the index
        self.sailfin_checksums, self.sailfin_entries = sums, entries


def restricted_reader(base: type, *args: Any, **kwargs: Any) -> Any:
    """A DCP reader of class ``base`` (``FileSystemReader``, ``FsspecReader``) built with
    ``args``, that reads ``.metadata`` with :func:`~sailfin.compat.torch.read_dcp_metadata`
    (only DCP's metadata classes), never with ``pickle.load``."""
    return _restricted(base)(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _restricted(base: type) -> type:
    return type(f"Restricted{base.__name__}", (_RestrictedMetadataMixin, base), {})


class _RestrictedMetadataMixin:
    fs: Any
    path: Any

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        name = METADATA if rank is None else f"__{rank}{METADATA}"
        path = self.fs.concat_path(self.path, name)
        with self.fs.create_stream(path, "rb") as stream:
            metadata = parse_metadata(stream, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


METADATA = ".metadata"


def parse_metadata(stream: Any, shown: str) -> Any:
    """DCP's index from ``stream``, read with the allow-list; anything else is damage."""
    try:
        return read_dcp_metadata(stream)
    except Exception as exc:  # a parse of a file's bytes: any failure means a bad file
        reason = str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointCorrupt(f"checkpoint shard index {shown} is not DCP's metadata "
                                f"({reason}): it is damaged or was tampered with, and is not "
                                "loaded, since unpickling it could run any code", shown) from None


def check_index(storage: Storage, path: str, files: dict[str, Any]) -> None:
    """Read a checked DCP directory's index with the allow-list now, on every rank (it
    checked the index's checksum itself: :func:`verify`): a forged one is damage that
    ``resume: auto`` falls back from, found before any rank loads a thing."""
    index = storage.join(path, METADATA)
    shown = storage.display(index)
    if METADATA not in files:
        raise CheckpointCorrupt(f"checkpoint manifest for {storage.display(path)} lists no "
                                f"{METADATA}: it is damaged", shown)
    with open_checked(storage, index, shown, what="checkpoint shard", within=path) as stream:
        parse_metadata(stream, shown)


def describe(sums: dict[str, tuple[int, int]]) -> dict[str, dict[str, Any]]:
    """The manifest's entries for ``sums``."""
    return {name: {"size": size, ALGORITHM: f"{crc:08x}"} for name, (size, crc) in sums.items()}


def verify(storage: Storage, path: str, files: dict[str, Any], rank: int = 0,
           world_size: int = 1) -> None:
    """Check this rank's share of the files (``i % world_size == rank``) and the index
    ``.metadata`` (every rank unpickles it: every rank checks it first) against the
    manifest; raise :class:`CheckpointCorrupt` naming the first damaged one.

    Entries are ``{"size": n, "crc32c"|"crc32": hex}`` or, from sailfin before
    checksums, a bare size (then only the size is checked, on every rank)."""
    for i, (name, entry) in enumerate(sorted(files.items())):
        if not plain_shard_name(name):
            shown = storage.display(path)
            raise CheckpointCorrupt(f"checkpoint manifest for {shown} lists shard {name!r}, "
                                    "not a file name in the shard directory: it is damaged or "
                                    "was tampered with; sailfin reads nothing outside it", shown)
        file = storage.join(path, name)
        shown = storage.display(file)
        expected_size = entry["size"] if isinstance(entry, dict) else entry
        if isinstance(expected_size, bool) or not isinstance(expected_size, int):
            raise ValueError(f"size {expected_size!r}")  # a malformed shard list
        algorithm = next((a for a in ("crc32c", ALGORITHM) if isinstance(entry, dict)
                          and a in entry), None)
        checksum = algorithm is not None and (i % world_size == rank or name == METADATA)
        update = crc32
        if checksum and algorithm != ALGORITHM:
            # Written by a sailfin that picked CRC-32C when a package for it was importable.
            update = _crc32c()  # type: ignore[assignment]
            if update is None:
                raise CheckpointError(
                    f"checkpoint shard {shown} carries a CRC-32C checksum (an older sailfin "
                    "wrote it on a machine with a crc32c package); install one to check it: "
                    "pip install google-crc32c")
        try:
            # Every rank checks every size (a stat); a rank reads only its share.
            with open_checked(storage, file, shown, what="checkpoint shard",
                              expected_size=expected_size, within=path) as stream:
                if not checksum:
                    continue
                got_size, crc = checksum_stream(stream, update)
        except FileNotFoundError:
            raise CheckpointCorrupt(f"checkpoint shard {shown} is missing", shown) from None
        except OSError as exc:  # an I/O error
            raise CheckpointCorrupt(f"checkpoint shard {shown} is unreadable: {exc}",
                                    shown) from None
        if got_size != expected_size or crc != int(entry[algorithm], 16):
            raise CheckpointCorrupt(f"checkpoint shard {shown} does not match its {algorithm} "
                                    "in the manifest: it was altered or damaged after it was "
                                    "saved", shown)


def _crc32c() -> Optional[Callable[..., int]]:
    """CRC-32C, to check the shards of a checkpoint an older sailfin wrote with it."""
    with contextlib.suppress(ImportError):
        import google_crc32c  # type: ignore[import-not-found]

        return lambda data, crc: google_crc32c.extend(crc, bytes(data))
    with contextlib.suppress(ImportError):
        import crc32c  # type: ignore[import-not-found]

        return lambda data, crc: crc32c.crc32c(data, crc)
    return None
