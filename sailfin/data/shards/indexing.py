"""Finding each shard's index at start-up: beside the shard, in the cache, or by
scanning the tar once (and keeping the result).

Local shard ``a/shard-000000.tar``:
  1. ``a/shard-000000.tar.idx`` if present (checked against the shard's size);
  2. else an index cached earlier in the cache directory (keyed by path, size
     and modification time, so an edited shard is indexed again);
  3. else the tar's headers are scanned and the index written beside the shard,
     or into the cache directory when the shard's directory is read-only.
Remote shard ``https://host/shard-000000.tar``:
  1. the cached copy of its index; 2. ``https://host/shard-000000.tar.idx``;
  3. else the shard is downloaded into the cache (it will be read anyway) and
     scanned, and the index kept in the cache.
"""

from __future__ import annotations

import os
from typing import Optional

from ...utils.voice import say
from .errors import ShardError, where
from .index import INDEX_SUFFIX, ShardIndex, write_atomic
from .remote import ShardCache
from .tarformat import TarFormatError, scan
from .urls import kind, local_path


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
            try:
                index = ShardIndex.from_json(data, url + INDEX_SUFFIX)
            except ValueError as exc:
                raise ShardError(str(exc), url) from None
            _save(index, cached)
            return index
    path = cache.fetch(url)
    index = _scan(path, url, skip_bad)
    if index is not None:
        _save(index, cached)
        return index
    return _scan_partial(path, url)


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
    index = _scan(path, url, skip_bad)
    if index is None:
        return _scan_partial(path, url)
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
        data = f.read()
    try:
        return ShardIndex.from_json(data, path)
    except ValueError as exc:
        raise ShardError(str(exc), path) from None


def _save(index: ShardIndex, path: str) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_atomic(path, index.to_json().encode())
    except OSError as exc:  # an index we cannot keep is rebuilt next time: not fatal
        say(f"could not cache the shard index at {path} ({exc})", warning=True)


def _scan(path: str, url: str, skip_bad: bool) -> Optional[ShardIndex]:
    """Index by scanning headers; None when the tar is damaged and ``skip_bad``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        try:
            index = ShardIndex.from_members(scan(fd, size), size)
            index.add_checksums(fd)  # one read of the shard: later changes are found
            return index
        except TarFormatError as exc:
            if not skip_bad:
                raise ShardError(f"{where(url, offset=exc.offset)}: {exc}; re-create the "
                                 "shard, or set on_error='skip' to use the samples before "
                                 "the damage", url, offset=exc.offset) from None
            return None
    finally:
        os.close(fd)


def _scan_partial(path: str, url: str) -> ShardIndex:
    """The samples before the first damaged header (not saved: a repaired shard is
    indexed again). The last of them may miss members that came after the damage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        members = []
        try:
            for member in scan(fd, size):
                members.append(member)
        except TarFormatError as exc:
            say(f"{where(url, offset=exc.offset)}: {exc}; using the {len(members)} members "
                "before it", warning=True)
        # tar_bytes is the real size: the reader must not treat the shard as truncated.
        return ShardIndex.from_members(members, size)
    finally:
        os.close(fd)
