"""A memory snapshot's files: its name, its manifest, and whether it is intact."""

from __future__ import annotations

import os
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
