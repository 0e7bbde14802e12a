"""A memory snapshot's files: its name, its manifest, whether it is intact, and removing
or recycling the old ones."""

from __future__ import annotations

import os
import re
import shutil
from typing import Any, Optional

from . import manifest as manifests
from .errors import CheckpointCorrupt
from .serialize import _checksum_file


STEP = re.compile(r"^step-(\d+)$")
_OWN = re.compile(r"^rank(\d+)$")
_REPLICA = re.compile(r"^replica-rank(\d+)$")


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


def prune_snapshots(directory: str, keep_from: int = 0, only: Optional[int] = None,
                    spare: Optional[str] = None) -> None:
    """Remove the snapshots in ``directory`` older than ``keep_from`` (with ``only``: every
    step but that one) and anything unfinished, but the entry named ``spare``."""
    for name in sorted(_names(directory)):
        match = STEP.match(name)
        step = int(match.group(1)) if match else None
        if name != spare and (step is None or (
                step != only if only is not None else step < keep_from)):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def recycle(directory: str, keep_from: int, step: int) -> str:
    """Before ``step`` is written in ``directory``: the oldest snapshot older than
    ``keep_from`` becomes its temporary directory, whose files the writer rewrites in
    place (their pages reused: freeing and allocating a snapshot's pages costs as much
    as writing them). Its manifest goes first: a directory being rewritten never holds
    one. Returns the temporary directory's name (the others older are the caller's to
    remove)."""
    temporary = f".tmp-{step_name(step)}"
    older = sorted(name for name in _names(directory)
                   if STEP.match(name) and int(name[5:]) < keep_from)
    if older and not os.path.exists(os.path.join(directory, temporary)):
        os.rename(os.path.join(directory, older[0]), os.path.join(directory, temporary))
        manifest = os.path.join(directory, temporary, manifests.MANIFEST)
        if os.path.exists(manifest):
            os.remove(manifest)
    return temporary


def held(root: str, world_size: int, run: str) -> dict[int, dict[int, str]]:
    """Rank -> step -> directory of every complete, intact snapshot in the node's
    directory ``root`` (own or replica) that a rank of the run ``run`` can resume from.
    Left out: a snapshot without a manifest, or whose files do not have its sizes (a
    half-written one; CRC-32s are checked when the one snapshot resumed is loaded), or
    taken by another run, or sharded on another world size (a resized fsdp job resumes
    from disk), or whose node copy of the replicated state is not here intact."""
    found: dict[int, dict[int, tuple[str, Optional[int]]]] = {}
    for entry in sorted(_names(root)):  # own copies before replicas
        match = _OWN.match(entry) or _REPLICA.match(entry)
        if not match or int(match.group(1)) >= world_size:
            continue
        rank = int(match.group(1))
        for name in _names(os.path.join(root, entry)):
            step = STEP.match(name)
            path = os.path.join(root, entry, name)
            if not step or int(step.group(1)) in found.get(rank, {}):
                continue
            manifest = intact(path, world_size, run, verify=False)
            if manifest is not None:
                source = (manifest.get("memory_snapshot") or {}).get("shared_from")
                found.setdefault(rank, {})[int(step.group(1))] = (path, source)
    return {rank: {step: path for step, (path, source) in steps.items()
                   if source is None or found.get(source, {}).get(step, ("", 0))[1] is None}
            for rank, steps in found.items()}


def _names(directory: str) -> list[str]:
    """The names in ``directory``; none when it is gone (or not a directory)."""
    try:
        return os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
