"""The shard index: where each sample's members lie in a tar.

``shard-000000.tar`` has its index beside it as ``shard-000000.tar.idx``, a small JSON
document (byte offset, size and CRC-32 of every member, grouped into samples the
WebDataset way), so a sample is one positional read. Its fields, and where a shard's
index comes from at start-up, are in docs/streaming.md ("Shards and their indexes").
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Optional

import numpy as np

from ...utils.crc import crc32
from ...utils.voice import say
from .errors import ShardError, where
from .remote import ShardCache, kind, local_path
from .tarformat import Member, TarFormatError, scan

FORMAT = "sailfin-shard-index"
VERSION = 1
INDEX_SUFFIX = ".idx"


@dataclass
class ShardIndex:
    """The samples of one shard and the byte ranges of their members.

    Example::

        index = ShardIndex.from_members(tarformat.scan(fd, size), size)
        index.save("shard-000000.tar.idx")
    """

    tar_bytes: int
    exts: tuple[str, ...]
    keys: list[str]
    member_start: np.ndarray   # int64, num_samples + 1: sample j owns members [s[j], s[j+1])
    ext_ids: np.ndarray        # int32 per member
    offsets: np.ndarray        # int64 per member
    sizes: np.ndarray          # int64 per member
    crc32: Optional[np.ndarray] = None  # uint32 per member; None in indexes without checksums

    @property
    def num_samples(self) -> int:
        return len(self.keys)

    @classmethod
    def from_members(cls, members: Iterable[Member], tar_bytes: int) -> "ShardIndex":
        exts: dict[str, int] = {}
        keys: list[str] = []
        counts: list[int] = []
        ext_ids, offsets, sizes, crcs = [], [], [], []
        for m in members:
            key, ext = split_name(m.name)
            if not ext:
                continue
            if not keys or keys[-1] != key:
                keys.append(key)
                counts.append(0)
            counts[-1] += 1
            ext_ids.append(exts.setdefault(ext, len(exts)))
            offsets.append(m.offset)
            sizes.append(m.size)
            crcs.append(m.crc32)
        crcs = None if None in crcs else crcs  # all members have one, or the index has none
        return cls._build(tar_bytes, tuple(exts), keys, counts, ext_ids, offsets, sizes, crcs)

    @classmethod
    def _build(cls, tar_bytes: int, exts: tuple[str, ...], keys: list[str], counts,
               ext_ids, offsets, sizes, crcs=None) -> "ShardIndex":
        start = np.zeros(len(keys) + 1, dtype=np.int64)
        np.cumsum(np.asarray(counts, dtype=np.int64), out=start[1:])
        return cls(int(tar_bytes), exts, list(keys), start,
                   np.asarray(ext_ids, dtype=np.int32), np.asarray(offsets, dtype=np.int64),
                   np.asarray(sizes, dtype=np.int64),
                   None if crcs is None else np.asarray(crcs, dtype=np.uint32))

    def add_checksums(self, fd: int) -> None:
        """Checksum every member's data in the file open at ``fd`` (an index made by
        scanning a tar's headers has none): from now on a changed byte is found."""
        crcs = np.empty(len(self.offsets), dtype=np.uint32)
        for m, (offset, size) in enumerate(zip(self.offsets.tolist(), self.sizes.tolist())):
            crcs[m] = crc32(os.pread(fd, size, offset))
        self.crc32 = crcs

    # -- the file beside the shard ------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({
            "format": FORMAT, "version": VERSION, "tar_bytes": self.tar_bytes,
            "exts": list(self.exts), "keys": self.keys,
            "members": np.diff(self.member_start).tolist(), "ext_ids": self.ext_ids.tolist(),
            "offsets": self.offsets.tolist(), "sizes": self.sizes.tolist(),
            **({"crc32": self.crc32.tolist()} if self.crc32 is not None else {}),
        }, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> "ShardIndex":
        try:
            doc = json.loads(text)
            if doc.get("format") != FORMAT:
                raise ValueError(f"not a {FORMAT} document")
            if doc.get("version") != VERSION:
                raise ValueError(f"version {doc.get('version')} (this sailfin reads {VERSION})")
            index = cls._build(doc["tar_bytes"], tuple(doc["exts"]), doc["keys"],
                               doc["members"], doc["ext_ids"], doc["offsets"], doc["sizes"],
                               doc.get("crc32"))
            index._check()
            return index
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"shard index {where} is unreadable ({exc}); delete it and "
                             "sailfin re-indexes the shard on the next run") from None

    def save(self, path: str) -> None:
        """Write atomically: a crash leaves the old index or none, never half of one."""
        write_atomic(path, self.to_json().encode())

    def _check(self) -> None:
        n = len(self.offsets)
        if not (len(self.ext_ids) == len(self.sizes) == n == self.member_start[-1]):
            raise ValueError("member arrays disagree in length")
        if n and (self.ext_ids.max() >= len(self.exts) or self.ext_ids.min() < 0):
            raise ValueError("an extension id is out of range")
        if n and int((self.offsets + self.sizes).max()) > self.tar_bytes:
            raise ValueError("a member ends past tar_bytes")
        if n and (int(self.offsets.min()) < 0 or int(self.sizes.min()) < 0):
            raise ValueError("a member has a negative offset or size")
        if n > 1:
            # Members lie in file order, each after the previous one's data.
            ends = self.offsets[:-1] + self.sizes[:-1]
            bad = np.flatnonzero(self.offsets[1:] < ends)
            if len(bad):
                m = int(bad[0]) + 1
                raise ValueError(f"member {m} starts at byte {int(self.offsets[m])}, inside or "
                                 f"before member {m - 1} (byte {int(self.offsets[m - 1])}): the "
                                 "offsets are out of order")
        if self.crc32 is not None and len(self.crc32) != n:
            raise ValueError("crc32 and the member arrays disagree in length")

    # -- what the reader needs ------------------------------------------------------------
    def table(self) -> "Table":
        """The index as plain Python lists: indexing them per sample is cheaper than numpy."""
        exts = self.exts
        return Table(self.keys, self.member_start.tolist(), self.offsets.tolist(),
                     self.sizes.tolist(), [exts[i] for i in self.ext_ids.tolist()],
                     None if self.crc32 is None else self.crc32.tolist())


class Table(NamedTuple):
    """One shard's index, unpacked for reading (see :meth:`ShardIndex.table`)."""

    keys: list[str]
    starts: list[int]    # sample j owns members [starts[j], starts[j + 1])
    offsets: list[int]
    sizes: list[int]
    exts: list[str]      # per member
    crcs: Optional[list[int]] = None  # per member, when the index has checksums

    def sample(self, j: int) -> tuple[str, int, int, list[tuple[str, int, int]]]:
        """Sample ``j``: key, first and end byte, and its members as (ext, start, stop)
        relative to the first byte."""
        a, b = self.starts[j], self.starts[j + 1]
        offsets, sizes, exts = self.offsets, self.sizes, self.exts
        lo = offsets[a]
        return (self.keys[j], lo, offsets[b - 1] + sizes[b - 1],
                [(exts[m], offsets[m] - lo, offsets[m] - lo + sizes[m]) for m in range(a, b)])

    def damaged_member(self, j: int, buf: bytes, lo: int) -> Optional[tuple[str, int]]:
        """(extension, byte offset) of sample ``j``'s first member whose bytes in ``buf``
        (read from byte ``lo``) do not match its CRC-32; None when all match or the
        index has no checksums."""
        crcs = self.crcs
        if crcs is None:
            return None
        view = memoryview(buf)
        offsets, sizes = self.offsets, self.sizes
        for m in range(self.starts[j], self.starts[j + 1]):
            a = offsets[m] - lo
            if crc32(view[a:a + sizes[m]]) != crcs[m]:
                return self.exts[m], offsets[m]
        return None


def split_name(name: str) -> tuple[str, str]:
    """``dir/000123.x.npy`` -> (``dir/000123``, ``x.npy``): WebDataset's key and extension."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1:]


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to a temporary name in the same directory, then rename over ``path``."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_index(url: str, cache: ShardCache, skip_bad: bool) -> ShardIndex:
    """The index of shard ``url``; ShardError (naming the URL) if it cannot be had."""
    if kind(url) == "local":
        return _local_index(url, cache, skip_bad)
    cached = cache.path_for(url) + INDEX_SUFFIX
    if os.path.exists(cached):
        return _read(cached)
    if kind(url) != "pipe":
        data = cache.read_small(url + INDEX_SUFFIX)
        if data is not None:
            index = _parse(data, url + INDEX_SUFFIX, url)
            _save(index, cached)
            return index
    index, whole = _scan(cache.fetch(url), url, skip_bad)
    if whole:
        _save(index, cached)
    return index


def _local_index(url: str, cache: ShardCache, skip_bad: bool) -> ShardIndex:
    path = local_path(url)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ShardError(f"shard {url} does not exist: check the path or the shard "
                         "pattern", url) from None
    beside = path + INDEX_SUFFIX
    if os.path.exists(beside):
        index = _read(beside)
        check_size(index, st.st_size, url, beside, skip_bad)
        return index
    cached = cache.path_for(f"{os.path.abspath(path)}@{st.st_size}@{st.st_mtime_ns}") \
        + INDEX_SUFFIX
    if os.path.exists(cached):
        return _read(cached)
    index, whole = _scan(path, url, skip_bad)
    if not whole:
        return index
    try:
        index.save(beside)
    except OSError:  # a read-only data directory: keep the index in the cache instead
        _save(index, cached)
    return index


def check_size(index: ShardIndex, size: int, url: str, index_name: str, skip_bad: bool) -> None:
    """A shard must be as long as its index says: shorter means truncated."""
    if size == index.tar_bytes:
        return
    message = (f"shard {url} is {size} bytes but its index {index_name} describes "
               f"{index.tar_bytes} bytes")
    if size < index.tar_bytes and skip_bad:
        say(f"{message}: the shard is truncated; samples past byte {size} will be skipped",
            warning=True)
        return
    raise ShardError(f"{message}: the shard is truncated or was rewritten after it was "
                     "indexed. Re-create the shard, or delete the index to index it again "
                     "(a truncated shard then fails at the damaged member)", url)


def _read(path: str) -> ShardIndex:
    with open(path, "rb") as f:
        return _parse(f.read(), path, path)


def _parse(data: bytes, where: str, url: str) -> ShardIndex:
    try:
        return ShardIndex.from_json(data, where)
    except ValueError as exc:
        raise ShardError(str(exc), url) from None


def _save(index: ShardIndex, path: str) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_atomic(path, index.to_json().encode())
    except OSError as exc:  # an index we cannot keep is rebuilt next time: not fatal
        say(f"could not cache the shard index at {path} ({exc})", warning=True)


def _scan(path: str, url: str, skip_bad: bool) -> tuple[ShardIndex, bool]:
    """Index by scanning headers, and whether it is whole (then checksummed, to keep).
    A damaged tar with ``skip_bad``: the samples before the damage (the last may miss
    members after it), not to keep (a repaired shard is indexed again)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        members = []
        try:
            for member in scan(fd, size):
                members.append(member)
        except TarFormatError as exc:
            if not skip_bad:
                raise ShardError(f"{where(url, offset=exc.offset)}: {exc}; re-create the "
                                 "shard, or set on_error='skip' to use the samples before "
                                 "the damage", url, offset=exc.offset) from None
            say(f"{where(url, offset=exc.offset)}: {exc}; using the {len(members)} members "
                "before it", warning=True)
            # tar_bytes is the real size: the reader must not treat the shard as truncated.
            return ShardIndex.from_members(members, size), False
        index = ShardIndex.from_members(members, size)
        index.add_checksums(fd)  # one read of the shard: later changes are found
        return index, True
    finally:
        os.close(fd)
