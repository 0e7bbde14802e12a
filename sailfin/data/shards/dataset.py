"""ShardDataset: tar shards read as a map-style dataset, one positional read per sample."""

from __future__ import annotations

import bisect
import os
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch

from ...config.errors import suggest
from ...utils.voice import say
from ..sampler import window_order
from .codecs import DECODE_MODES, Decoder, decoder_for
from .errors import ShardError, SharedCounter, where
from .index import ShardIndex, Table, check_size, load_index
from .remote import ShardCache, Urls, expand_urls, kind, local_path

ON_ERROR = ("raise", "skip")


class ShardDataset(torch.utils.data.Dataset):
    """Samples stored in tar shards (the WebDataset layout), readable by index.

    ``urls``: a path, URL, glob, directory or brace pattern, or a list of them (local,
    ``http(s)://``, or any fsspec URL with ``pip install 'sailfin[remote]'``). Every
    index loads here, so a bad pattern or unreachable URL fails now, not mid-epoch.
    ``ds[i]`` (shards in list order, samples in file order) is a dict ``{"__key__",
    "__url__", ext: value}`` decoded by extension, the tuple of ``fields``, or what
    ``decode(raw_dict)`` returns; then ``transform`` applies. ``epoch_order`` (what the
    trainer's sampler follows) is :func:`window_order`. ``on_error="skip"`` drops
    unreadable samples from their micro-batch and counts them (:attr:`skipped_samples`).
    Each member is checked against its index's CRC-32 (``verify_checksums``); a
    mismatch is a ShardError naming shard, sample and offset, like any bad sample.

    Example::

        ds = ShardDataset("data/shard-{000000..000099}.tar", fields=("png", "cls"))
        loader = DataLoader(ds, batch_size=micro, sampler=sampler(ds), num_workers=2)
    """

    def __init__(self, urls: Urls, *, decode: Union[str, Callable[[dict], Any]] = "numpy",
                 fields: Optional[Sequence[str]] = None,
                 transform: Optional[Callable[[Any], Any]] = None,
                 shuffle: bool = True, shuffle_window: int = 8, on_error: str = "raise",
                 cache_dir: Optional[str] = None, cache_limit: Union[int, str] = "20GB",
                 allow_pipe: bool = False, download_attempts: int = 3,
                 max_open_shards: int = 64, index_threads: int = 8,
                 verify_checksums: bool = True) -> None:
        if not callable(decode) and decode not in DECODE_MODES:
            raise ValueError(f"decode={decode!r}{suggest(decode, DECODE_MODES)}: use one of "
                             f"{', '.join(DECODE_MODES)} or a function of the raw sample dict")
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error={on_error!r}{suggest(on_error, ON_ERROR)}: use "
                             "'raise' or 'skip'")
        if shuffle_window < 1 or max_open_shards < 1:
            raise ValueError("shuffle_window and max_open_shards must be >= 1")
        self.urls = expand_urls(urls, allow_pipe)
        self.decode = decode
        if isinstance(fields, str):
            fields = (fields,)
        self.fields = tuple(fields) if fields is not None else None
        self.transform, self.shuffle, self.shuffle_window = transform, shuffle, shuffle_window
        self.on_error, self.verify_checksums = on_error, verify_checksums
        self.max_open_shards = max_open_shards
        self.cache = ShardCache(cache_dir, cache_limit, attempts=download_attempts)
        self.indexes = self._load_indexes(index_threads)
        self.counts = [ix.num_samples for ix in self.indexes]
        self._ends = np.cumsum(self.counts).tolist()
        self._starts = [0] + self._ends[:-1]
        if not self._ends[-1]:
            raise ShardError(f"the {len(self.urls)} shard(s) from {self.urls[0]} on hold no "
                             "samples (members need a key and an extension: 000123.png)")
        self._check_cache_limit()
        # DataLoader workers count into it; the trainer reads it in the main process.
        self._skipped = SharedCounter() if on_error == "skip" else None
        self._reset_process_state()

    # -- size and order ---------------------------------------------------------------------
    def __len__(self) -> int:
        return self._ends[-1]

    def epoch_order(self, seed: int, epoch: int) -> np.ndarray:
        """Dataset indices of epoch ``epoch`` in training order; a pure function of
        (shards, seed, epoch, shuffle_window), whatever the world size or workers."""
        return window_order(self.counts, seed, epoch, self.shuffle_window, self.shuffle)

    @property
    def skipped_samples(self) -> int:
        """Samples skipped as unreadable so far, over this process and its workers."""
        return self._skipped.value if self._skipped is not None else 0

    def __repr__(self) -> str:
        return f"ShardDataset({len(self.urls)} shards, {len(self)} samples, from {self.urls[0]})"

    # -- reading ----------------------------------------------------------------------------
    def __getitem__(self, i: int) -> Any:
        """Sample ``i``; None if it is unreadable and ``on_error='skip'``."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} is out of range for {n} samples")
        i %= n
        shard = bisect.bisect_right(self._ends, i)
        return self._read(shard, i - self._starts[shard])

    def __getitems__(self, indices: Sequence[int]) -> list:
        """A micro-batch: what the DataLoader fetches. Skipped samples are left out."""
        ends, starts = self._ends, self._starts
        out = []
        for i in indices:
            shard = bisect.bisect_right(ends, i)
            sample = self._read(shard, i - starts[shard])
            if sample is not None:
                out.append(sample)
        if not out:
            raise ShardError(f"every sample of a micro-batch of {len(indices)} is unreadable "
                             f"(samples {list(indices)[:8]}...; see the warnings above): the "
                             "data is too damaged for on_error='skip'; repair the shards")
        return out

    def _read(self, shard: int, j: int) -> Any:
        try:
            table = self._table(shard)
            key, lo, hi, members = table.sample(j)
            fd = self._fd(shard)
            buf = os.pread(fd, hi - lo, lo)
            if len(buf) != hi - lo:
                raise ShardError(f"{where(self.urls[shard], key, lo)}: needs {hi - lo} bytes "
                                 f"but the shard ends after {len(buf)} of them (truncated "
                                 "shard); re-create it", self.urls[shard], key, lo)
            bad = table.damaged_member(j, buf, lo) if self.verify_checksums else None
            if bad is not None:
                raise ShardError(f"{where(self.urls[shard], key, bad[1])}: member '.{bad[0]}' "
                                 "does not match its CRC-32 in the shard index: the shard was "
                                 "changed or damaged after it was written. Re-create it, or "
                                 "set on_error='skip' to leave such samples out",
                                 self.urls[shard], key, bad[1])
            sample = self._decode(shard, key, lo, buf, members)
        except ShardError as exc:
            if self._skipped is None:
                raise
            count = self._skipped.add()
            say(f"skipped sample ({count} so far): {exc}", warning=True)
            return None
        return sample if self.transform is None else self.transform(sample)

    def _decode(self, shard: int, key: str, lo: int, buf: bytes, members) -> Any:
        url = self.urls[shard]
        if callable(self.decode):
            raw = {"__key__": key, "__url__": url}
            raw.update((ext, buf[a:b]) for ext, a, b in members)
            return self._guard(self.decode, raw, url, key, lo, "decode function")
        if self.fields is not None:
            values = []
            for field in self.fields:
                for ext, a, b in members:
                    if ext == field:
                        values.append(self._guard(self._decoder(ext), buf[a:b], url, key,
                                                  lo + a, f"'.{ext}'"))
                        break
                else:
                    raise ShardError(
                        f"{where(url, key, lo)}: has no '.{field}' member (it has "
                        f"{', '.join('.' + m[0] for m in members)}); fix the shard, or "
                        "set on_error='skip'", url, key, lo)
            return tuple(values)
        sample = {"__key__": key, "__url__": url}
        for ext, a, b in members:
            sample[ext] = self._guard(self._decoder(ext), buf[a:b], url, key, lo + a,
                                      f"'.{ext}'")
        return sample

    @staticmethod
    def _guard(fn: Callable[[Any], Any], data: Any, url: str, key: str, offset: int,
               what: str) -> Any:
        try:
            return fn(data)
        except ShardError:
            raise
        except Exception as exc:  # a codec's error, whatever its type: name the member
            raise ShardError(f"{where(url, key, offset)}: cannot decode {what}: "
                             f"{type(exc).__name__}: {exc}", url, key, offset) from None

    def _decoder(self, ext: str) -> Decoder:
        fn = self._decoders.get(ext)
        if fn is None:
            fn = self._decoders[ext] = decoder_for(ext, str(self.decode))
        return fn

    # -- per-process state: open files, expanded indexes --------------------------------------
    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._tables: OrderedDict[int, Table] = OrderedDict()
        self._failed: dict[int, ShardError] = {}
        self._decoders: dict[str, Decoder] = {}

    def __getstate__(self) -> dict:
        # Open descriptors do not travel to spawned workers; each opens its own.
        state = self.__dict__.copy()
        for name in ("_fds", "_tables", "_failed", "_decoders"):
            state.pop(name)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset_process_state()

    def close(self) -> None:
        """Close the shard files this process has open (a later read opens them again)."""
        fds, self._fds = self._fds, OrderedDict()
        for fd in fds.values():
            os.close(fd)

    def __del__(self) -> None:
        # In a forked worker these are its own inherited copies: closing them is right.
        for fd in getattr(self, "_fds", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass

    def _table(self, shard: int) -> Table:
        table = self._tables.get(shard)
        if table is None:
            table = self._tables[shard] = self.indexes[shard].table()
            if len(self._tables) > 2 * self.max_open_shards:
                self._tables.popitem(last=False)
        return table

    def _fd(self, shard: int) -> int:
        if self._pid != os.getpid():  # a forked worker: the parent's descriptors stay its own
            for fd in self._fds.values():
                os.close(fd)
            self._reset_process_state()
        fd = self._fds.get(shard)
        if fd is not None:
            self._fds.move_to_end(shard)
            return fd
        if shard in self._failed:
            raise self._failed[shard]
        try:
            fd = self._open(shard)
        except ShardError as exc:
            self._failed[shard] = exc  # do not download a failing shard once per sample
            raise
        self._fds[shard] = fd
        if len(self._fds) > self.max_open_shards:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def _open(self, shard: int) -> int:
        url, index = self.urls[shard], self.indexes[shard]
        if kind(url) == "local":
            return os.open(local_path(url), os.O_RDONLY)
        try:
            fd = os.open(self.cache.fetch(url), os.O_RDONLY)
        except FileNotFoundError:  # evicted by another process between fetch and open
            fd = os.open(self.cache.fetch(url), os.O_RDONLY)
        try:
            check_size(index, os.fstat(fd).st_size, url, "(downloaded or cached index)",
                       self._skipped is not None)
        except ShardError:
            os.close(fd)
            raise
        return fd

    # -- start-up ---------------------------------------------------------------------------
    def _load_indexes(self, threads: int) -> list[ShardIndex]:
        skip = self.on_error == "skip"
        if all(kind(u) == "local" for u in self.urls) or threads <= 1:
            return [load_index(u, self.cache, skip) for u in self.urls]
        with ThreadPoolExecutor(min(threads, len(self.urls))) as pool:
            return list(pool.map(lambda u: load_index(u, self.cache, skip), self.urls))

    def _check_cache_limit(self) -> None:
        remote = sorted((ix.tar_bytes for u, ix in zip(self.urls, self.indexes)
                         if kind(u) != "local"), reverse=True)
        # A run of positions spans at most two windows: those shards must fit at once.
        need = sum(remote[:2 * self.shuffle_window])
        if need > self.cache.limit:
            raise ValueError(
                f"cache_limit={self.cache.limit} bytes cannot hold two shuffle windows of "
                f"shards ({need} bytes for shuffle_window={self.shuffle_window}): raise "
                "cache_limit or lower shuffle_window")
