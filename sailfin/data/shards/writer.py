"""ShardWriter: samples in, tar shards and their indexes out, each written atomically."""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from ...utils.crc import crc32
from .codecs import encode
from .index import INDEX_SUFFIX, ShardIndex
from .tarformat import END_OF_ARCHIVE, Member, header, padding


class ShardWriter:
    """Writes samples into ``{prefix}-{NNNNNN}.tar`` shards of ``samples_per_shard`` each.

    A sample is a dict of ``"__key__"`` and ``extension -> value``, values encoded by
    extension (see :mod:`sailfin.data.shards.codecs`). Each shard and its index
    (``.tar.idx``) are written under temporary names and renamed when complete; an
    exception in the ``with`` block discards only the shard being written. To write in
    parallel, give each process a disjoint ``start_index`` range (or its own ``prefix``).

    Example::

        with ShardWriter("data/shards", samples_per_shard=1000) as writer:
            for i, (image, label) in enumerate(pairs):
                writer.write({"__key__": f"{i:08d}", "png": image, "cls": label})
        writer.shards   # ['data/shards/shard-000000.tar', ...]
    """

    def __init__(self, directory: str, samples_per_shard: int = 1000, *,
                 prefix: str = "shard", start_index: int = 0) -> None:
        if samples_per_shard < 1:
            raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
        if start_index < 0:
            raise ValueError(f"start_index must be >= 0, got {start_index}")
        if "/" in prefix or not prefix:
            raise ValueError(f"prefix must be a plain file name part, got {prefix!r}")
        self.directory, self.samples_per_shard, self.prefix = directory, samples_per_shard, prefix
        self.next_index = start_index
        self.shards: list[str] = []       # finished shards, in order
        self._file: Optional[Any] = None  # the shard being written, at self._path
        self._path = ""
        self._members: list[Member] = []
        self._keys: set[str] = set()
        self._count = self._pos = 0
        os.makedirs(directory, exist_ok=True)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._discard()

    def write(self, sample: Mapping[str, Any]) -> None:
        """Append one sample; starts a new shard after ``samples_per_shard`` of them."""
        key = sample.get("__key__")
        if not isinstance(key, str) or not key or "." in key.rsplit("/", 1)[-1]:
            raise ValueError(f"a sample needs a '__key__' string without a dot in its last "
                             f"path part (the dot starts the extension), got {key!r}")
        fields = [(ext, value) for ext, value in sample.items() if not ext.startswith("__")]
        if not fields:
            raise ValueError(f"sample '{key}' has no fields: add e.g. 'png': image, 'cls': 3")
        blob = bytearray()
        offsets = []
        for ext, value in fields:
            try:
                data = encode(ext, value)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"sample '{key}', field '{ext}': {exc}") from None
            head = header(f"{key}.{ext}", len(data))
            offsets.append((ext, len(blob) + len(head), len(data), crc32(data)))
            blob += head
            blob += data
            blob += padding(len(data))
        if self._file is None:
            self._open()
        if key in self._keys:
            raise ValueError(f"sample key '{key}' appears twice in {self._path}: keys must be "
                             "unique within a shard")
        self._keys.add(key)
        for ext, rel, size, crc in offsets:
            self._members.append(Member(f"{key}.{ext}", self._pos + rel, size, crc))
        self._file.write(blob)
        self._pos += len(blob)
        self._count += 1
        if self._count >= self.samples_per_shard:
            self._finish()

    def close(self) -> None:
        """Finish the last (possibly smaller) shard."""
        if self._file is not None:
            self._finish()

    # -- internals --------------------------------------------------------------------------
    def _open(self) -> None:
        name = f"{self.prefix}-{self.next_index:06d}.tar"
        self._path = os.path.join(self.directory, name)
        self._file = open(self._tmp(self._path), "wb")
        self._members, self._keys, self._count, self._pos = [], set(), 0, 0

    def _finish(self) -> None:
        self._file.write(END_OF_ARCHIVE)
        size = self._pos + len(END_OF_ARCHIVE)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        # The old index goes first: a crash after it leaves a shard with no index
        # (indexed again on first read), never a shard with a wrong one.
        idx_path = self._path + INDEX_SUFFIX
        if os.path.exists(idx_path):
            os.unlink(idx_path)
        os.replace(self._tmp(self._path), self._path)
        ShardIndex.from_members(self._members, size).save(idx_path)
        self.shards.append(self._path)
        self.next_index += 1

    def _discard(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            if os.path.exists(self._tmp(self._path)):
                os.unlink(self._tmp(self._path))

    @staticmethod
    def _tmp(path: str) -> str:
        return f"{path}.tmp-{os.getpid()}"
