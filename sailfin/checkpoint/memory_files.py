"""A memory snapshot's files: whether a snapshot is intact, and one as a byte string.

A replica travels between nodes as one byte string (:func:`pack`), written on
the other side as a complete snapshot directory or not at all (:func:`unpack`).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional

from . import manifest as manifests
from .errors import CheckpointCorrupt
from .serialize import _checksum_file


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of the snapshot in ``path`` (raises OSError, CheckpointCorrupt)."""
    manifest_path = os.path.join(path, manifests.MANIFEST)
    with open(manifest_path, "rb") as fh:
        return manifests.decode(fh.read(), manifest_path)


def intact(path: str, world_size: Optional[int] = None, run: Optional[str] = None,
           verify: bool = True) -> Optional[dict[str, Any]]:
    """The manifest of the snapshot in ``path`` if it is complete and every file matches
    it (and it was taken by the run ``run``, on ``world_size`` ranks unless it holds
    replicated state, which any world size resumes); else None. ``verify=False``
    compares sizes only: the CRC-32s are checked when the snapshot is loaded."""
    try:
        manifest = read_manifest(path)
        files = manifests.files_of(manifest, os.path.join(path, manifests.MANIFEST))
        about = manifest.get("memory_snapshot") or {}
        if world_size is not None and manifest.get("world_size") != world_size \
                and not about.get("replicated"):
            return None
        if run is not None and about.get("run") != run:
            return None
        if verify and all(_checksum_file(os.path.join(path, name)) == (entry.size, entry.crc32)
                          for name, entry in files.items()):
            return manifest
        if not verify and all(os.path.getsize(os.path.join(path, name)) == entry.size
                              for name, entry in files.items()):
            return manifest
    except (OSError, CheckpointCorrupt):
        pass
    return None


def pack(path: str) -> bytes:
    """A snapshot directory's files as one byte string (a JSON header, then the bytes)."""
    names = sorted(os.listdir(path))
    blobs = []
    for name in names:
        with open(os.path.join(path, name), "rb") as fh:
            blobs.append(fh.read())
    header = json.dumps({n: len(b) for n, b in zip(names, blobs)}).encode("utf-8")
    return len(header).to_bytes(8, "little") + header + b"".join(blobs)


def unpack(data: bytes, directory: str, step: int) -> str:
    """Write what :func:`pack` made as ``directory/step-N``, complete or not at all."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size].decode("utf-8"))
    staging = os.path.join(directory, f".tmp-{step_name(step)}")
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    view, offset = memoryview(data), 8 + size
    # The manifest last, as in every save: without it the copy is incomplete.
    for name in sorted(header, key=lambda n: n == manifests.MANIFEST):
        start = offset + _before(header, name)
        with open(os.path.join(staging, name), "wb") as fh:
            fh.write(view[start:start + header[name]])
    final = os.path.join(directory, step_name(step))
    shutil.rmtree(final, ignore_errors=True)
    os.rename(staging, final)
    return final


def _before(header: dict[str, int], name: str) -> int:
    """Where ``name``'s bytes start in the packed data (after the header)."""
    total = 0
    for other in header:  # the order pack wrote them in
        if other == name:
            return total
        total += header[other]
    raise KeyError(name)
