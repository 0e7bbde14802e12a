"""Remote shards: fetched whole into a local cache, then read like local ones.

A shard is downloaded in one sequential request (HTTP with the standard
library; any other ``scheme://`` through fsspec, the ``remote`` extra) into
the cache directory under a temporary name and renamed when complete, so a
killed download never leaves a half shard that looks whole. Every process on
the machine (ranks, DataLoader workers) shares the cache: a lock file per
shard makes one process download while the others wait. When the cache grows
past its size cap the least recently used shards are deleted; a process that
still has one open keeps reading it (POSIX keeps an unlinked file alive while
it is open).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from typing import IO, Iterator, Optional, Union

from .errors import ShardError
from .urls import kind

_PART = ".part-"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def default_cache_dir() -> str:
    return os.environ.get("SAILFIN_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "sailfin", "shards")


def parse_size(value: Union[int, str], what: str = "cache_limit") -> int:
    """``20GB``, ``512MiB``, ``1e9`` or an int -> bytes."""
    if isinstance(value, int):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"{what}={value!r} is not a size: write e.g. 20GB, 512MiB or 1000000")
    number, unit = match.groups()
    unit = unit.lower().rstrip("b")
    return int(float(number) * _UNITS[unit])


def fsspec_module():
    try:
        import fsspec
    except ImportError:
        raise ImportError("reading shards from object storage needs fsspec: "
                          "pip install 'sailfin[remote]' (plus the store's package, e.g. "
                          "s3fs for s3://)") from None
    return fsspec


class ShardCache:
    """Local copies of remote shards, capped at ``limit`` bytes (least recently used go).

    Example::

        cache = ShardCache("/tmp/shards", limit=20 * 2**30)
        path = cache.fetch("https://host/shard-000000.tar")   # downloads once
    """

    def __init__(self, directory: Optional[str] = None, limit: Union[int, str] = "20GB",
                 timeout: float = 60.0, attempts: int = 3) -> None:
        self.directory = os.path.abspath(directory or default_cache_dir())
        self.limit = parse_size(limit)
        self.timeout = timeout
        self.attempts = max(1, attempts)
        if self.limit < 1:
            raise ValueError(f"cache_limit must be positive, got {limit!r}")

    def path_for(self, url: str) -> str:
        digest = hashlib.sha1(url.encode()).hexdigest()[:16]
        name = re.sub(r"[^A-Za-z0-9._-]", "_", url.rstrip("/").rsplit("/", 1)[-1])[-80:]
        return os.path.join(self.directory, f"{digest}-{name}")

    def fetch(self, url: str) -> str:
        """The local path of ``url``'s bytes, downloading them unless cached."""
        path = self.path_for(url)
        if self._touch(path):
            return path
        os.makedirs(self.directory, exist_ok=True)
        with self._lock(path):
            if self._touch(path):  # another process fetched it while we waited
                return path
            self._download(url, path)
        self._evict(keep=path)
        return path

    def read_small(self, url: str) -> Optional[bytes]:
        """The bytes at ``url`` (an index file), or None if there is nothing there."""
        try:
            with _open_remote(url, self.timeout) as src:
                return src.read()
        except FileNotFoundError:
            return None
        except urllib.error.HTTPError as exc:
            if exc.code in (403, 404, 410):
                return None
            raise ShardError(f"cannot read {url}: HTTP {exc.code} {exc.reason}", url) from None
        except (OSError, urllib.error.URLError) as exc:
            raise ShardError(f"cannot read {url}: {exc}; check the URL and that the server "
                             "is reachable", url) from None

    # -- internals --------------------------------------------------------------------------
    def _touch(self, path: str) -> bool:
        try:
            os.utime(path)  # the modification time is the cache's "last used" clock
            return True
        except FileNotFoundError:
            return False

    @contextlib.contextmanager
    def _lock(self, path: str) -> Iterator[None]:
        with open(path + ".lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _download(self, url: str, path: str) -> None:
        tmp = f"{path}{_PART}{os.getpid()}-{threading.get_ident()}"
        error: Optional[BaseException] = None
        for attempt in range(1, self.attempts + 1):
            try:
                with open(tmp, "wb") as out:
                    self._copy(url, out)
                os.replace(tmp, path)
                return
            except urllib.error.HTTPError as exc:
                error = exc
                if exc.code < 500:  # the URL is wrong, not the network: no retry
                    break
            except (OSError, urllib.error.URLError, ShardError) as exc:
                error = exc
                if isinstance(exc, FileNotFoundError) and kind(url) != "local":
                    break
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            if attempt < self.attempts:
                time.sleep(min(0.2 * 2 ** attempt, 5.0))
        raise ShardError(f"failed to download shard {url} (tried {attempt} time(s)): {error}; "
                         "check the URL, the server and the network", url) from None

    def _copy(self, url: str, out: IO[bytes]) -> None:
        if kind(url) == "pipe":
            command = url[len("pipe:"):]
            with subprocess.Popen(command, shell=True, stdout=subprocess.PIPE) as proc:
                shutil.copyfileobj(proc.stdout, out, 1 << 20)
            if proc.returncode:
                raise ShardError(f"command of shard {url} exited with {proc.returncode}", url)
            return
        with _open_remote(url, self.timeout) as src:
            expected = getattr(src, "length", None)  # HTTP Content-Length, when sent
            shutil.copyfileobj(src, out, 1 << 20)
        if expected is not None and out.tell() != expected:
            raise ShardError(f"download of {url} stopped after {out.tell()} of {expected} "
                             "bytes", url)

    def _evict(self, keep: str) -> None:
        entries = []
        now = time.time()
        with os.scandir(self.directory) as it:
            for entry in it:
                name = entry.name
                if name.endswith((".lock", ".idx")) or ".tmp-" in name:
                    continue
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                if _PART in name:  # left by a killed download
                    if now - st.st_mtime > 3600:
                        _unlink(entry.path)
                    continue
                entries.append((st.st_mtime, st.st_size, entry.path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.limit:
                break
            if path != keep:
                _unlink(path)
                # The lock only saves duplicate downloads (renames keep them safe).
                _unlink(path + ".lock")
                total -= size


def _open_remote(url: str, timeout: float) -> IO[bytes]:
    if kind(url) == "http":
        request = urllib.request.Request(url, headers={"User-Agent": "sailfin"})
        return urllib.request.urlopen(request, timeout=timeout)
    return fsspec_module().open(url, "rb").open()


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
