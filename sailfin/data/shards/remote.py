"""Where shards are: shard lists (braces, globs, directories), and remote shards fetched
whole into a local cache, then read like local ones (see docs/streaming.md, "Remote
shards and the cache").

``pipe:CMD`` reads a shard from a shell command's output: refused unless
``allow_pipe=True``, since shard lists come from config files that must not run
commands on the training machines. A download is written under a temporary name and
renamed when complete, so a killed one never looks whole; a lock file per shard makes
one process download while the others wait.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from typing import IO, Iterator, Optional, Sequence, Union

from .errors import ShardError, ShardURLError

Urls = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]]]
_GLOB = re.compile(r"[*?\[]")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


def kind(url: str) -> str:
    """``local``, ``http``, ``pipe`` or ``fsspec`` (any other ``scheme://``)."""
    if url.startswith("pipe:"):
        return "pipe"
    if url.startswith(("http://", "https://")):
        return "http"
    if url.startswith("file://") or "://" not in url:
        return "local"
    return "fsspec"


def local_path(url: str) -> str:
    return url[len("file://"):] if url.startswith("file://") else url


def expand_urls(urls: Urls, allow_pipe: bool = False) -> list[str]:
    """Every shard named by ``urls`` (a pattern or a list of them), in order.

    Raises ShardURLError (a ValueError and a ShardError) naming the pattern when nothing
    matches, a URL is a pipe that is not allowed, or a shard is named twice.
    """
    patterns = [urls] if isinstance(urls, (str, os.PathLike)) else list(urls)
    out: list[str] = []
    for pattern in map(os.fspath, patterns):
        for url in expand_braces(pattern):
            found = _resolve(url, allow_pipe)
            if not found:
                raise ShardURLError(f"shard pattern '{pattern}' matches no shard ({url} is an "
                                    "empty directory or a glob without matches)")
            out.extend(found)
    if not out:
        raise ShardURLError("the shard list is empty: give a list of shard URLs, a glob, a "
                            "directory or brace notation such as shard-{000000..000009}.tar")
    seen: set[str] = set()
    for url in out:
        if url in seen:
            raise ShardURLError(f"shard {url} is listed twice: its samples would be read twice "
                                "per epoch; remove the duplicate from the shard list")
        seen.add(url)
    return out


def _resolve(url: str, allow_pipe: bool) -> list[str]:
    where = kind(url)
    if where == "pipe":
        if not allow_pipe:
            raise ShardURLError(
                f"refusing shard URL '{url}': 'pipe:' runs a shell command, and shard lists "
                "often come from config files that must not run commands. Pass "
                "allow_pipe=True to ShardDataset if you wrote this command yourself")
        return [url]
    if where == "local":
        path = local_path(url)
        if _GLOB.search(path):
            return sorted(p for p in glob.glob(path) if not p.endswith(".idx"))
        if os.path.isdir(path):
            return sorted(glob.glob(os.path.join(glob.escape(path), "*.tar")))
        return [url]
    if where == "fsspec" and _GLOB.search(url.split("://", 1)[1]):
        fs, _, paths = fsspec_module().get_fs_token_paths(url)
        return sorted(fs.unstrip_protocol(p) for p in paths if not p.endswith(".idx"))
    if where == "http" and _GLOB.search(url.split("?", 1)[0].split("://", 1)[1]):
        raise ShardURLError(f"cannot glob over HTTP ('{url}'): name the shards with brace "
                            "notation, e.g. https://host/shard-{000000..000099}.tar")
    return [url]


def expand_braces(pattern: str) -> list[str]:
    """``a{1..3}b`` -> a1b a2b a3b; ``{x,y}`` -> x y; nested and repeated braces work."""
    start = pattern.find("{")
    if start < 0:
        return [pattern]
    depth = 0
    for end in range(start, len(pattern)):
        depth += {"{": 1, "}": -1}.get(pattern[end], 0)
        if depth == 0:
            break
    else:
        raise ShardURLError(f"unbalanced '{{' in shard pattern '{pattern}'")
    head, body, tail = pattern[:start], pattern[start + 1:end], pattern[end + 1:]
    tails = expand_braces(tail)
    return [head + alt + t for alt in _alternatives(body, pattern) for t in tails]


def _alternatives(body: str, pattern: str) -> list[str]:
    match = _RANGE.match(body)
    if match:
        a, b = match.groups()
        lo, hi = int(a), int(b)
        if hi < lo:
            raise ShardURLError(f"range {{{body}}} in shard pattern '{pattern}' counts down; "
                                f"write {{{b}..{a}}}")
        padded = (a.startswith("0") and len(a) > 1) or (b.startswith("0") and len(b) > 1)
        width = max(len(a), len(b)) if padded else 0
        return [str(i).zfill(width) for i in range(lo, hi + 1)]
    parts, depth, last = [], 0, 0
    for i, ch in enumerate(body):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(body[last:i])
            last = i + 1
    parts.append(body[last:])
    if len(parts) == 1:  # "{x}" is not an alternation: keep it literally, as a shell does
        return ["{" + alt + "}" for alt in expand_braces(body)]
    return [alt for part in parts for alt in expand_braces(part)]


_PART = ".part-"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.I)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(value: Union[int, str]) -> int:
    """``20GB``, ``512MiB``, ``1.5GiB``, ``1000000`` or an int -> bytes (no exponent form)."""
    if isinstance(value, int):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"cache_limit={value!r} is not a size: write e.g. 20GB, 512MiB or 1000000")
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

        path = ShardCache("/tmp/shards", limit="20GB").fetch("https://host/shard-000000.tar")
    """

    def __init__(self, directory: Optional[str] = None, limit: Union[int, str] = "20GB",
                 timeout: float = 60.0, attempts: int = 3) -> None:
        self.directory = os.path.abspath(directory or os.environ.get("SAILFIN_CACHE_DIR") or
                                         os.path.join(os.path.expanduser("~"), ".cache",
                                                      "sailfin", "shards"))
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
