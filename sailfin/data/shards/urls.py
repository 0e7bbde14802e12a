"""Shard lists: brace notation, globs, directories, and what kind of place a URL is.

``shards/shard-{000000..000099}.tar`` expands to 100 names (zero-padded like the
bounds); ``{train,val}/shard-{0..3}.tar`` to 8. Local globs and directories
(every ``*.tar`` inside, sorted) are resolved on disk; a glob on an fsspec
store is resolved by fsspec; HTTP cannot be listed, so use braces there.

``pipe:CMD`` runs ``CMD`` in a shell and reads the shard from its output. Shard
lists usually come from config files, and a config file must not be able to
run commands on the training machines, so pipes are refused unless the caller
passes ``allow_pipe=True``.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Sequence, Union

from .errors import ShardURLError

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

    Raises ShardURLError (a ValueError and a ShardError) naming the pattern when nothing matches, a URL is a pipe
    that is not allowed, or a shard is named twice.
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
        from .remote import fsspec_module

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
