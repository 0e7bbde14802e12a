"""Where memory snapshots live, whose they are, which are intact, and removing them.

One directory per run and node, on a RAM file system::

    /dev/shm/sailfin-<run id>-node<N>/
        owner-rank00000.json          run identity, host, pid and launcher pid of a writer
        rank00000/step-00000012/      rank 0's newest complete snapshot
        rank00000/.tmp-step-00000013/ the one being written
        replica-rank00001/step-...    another node's rank 1, kept here (replicas: 1)

The directory's name is a hash of ``trainer.output_dir``, so that a restarted
worker, a relaunched job and ``sailfin clean OUTPUT_DIR`` find it; a custom ``dir``
is recorded in ``OUTPUT_DIR/.memory-snapshots-node<N>``. Whose snapshots a run may
resume: docs/memory-snapshots.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import uuid
from typing import Any, Optional

from . import manifest as manifests
from .errors import CheckpointCorrupt
from .layout import DirectoryLayout
from .serialize import checksum_file

DEFAULT_PARENT = "/dev/shm"
PREFIX = "sailfin-"
RECORD = ".memory-snapshots-node"
IDENTITY = ".memory-snapshots-run"
STEP = re.compile(r"^step-(\d+)$")
_RANK_DIR = re.compile(r"^(?:replica-)?rank(\d+)$")


# A snapshot's directory is named as a checkpoint's on disk is.
step_name = DirectoryLayout.name_for


def run_id(output_dir: str) -> str:
    """The hash of the output directory's absolute path."""
    return hashlib.sha1(os.path.abspath(output_dir).encode("utf-8")).hexdigest()[:12]


def snapshot_root(dir_: Optional[str], output_dir: str, node: int) -> str:
    """This node's snapshot directory: ``dir_``, or one named after the run and node."""
    if dir_:
        return os.path.abspath(dir_)
    return os.path.join(DEFAULT_PARENT, f"{PREFIX}{run_id(output_dir)}-node{node}")


def _write_json(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(obj, fh)
    os.replace(tmp, path)


def record_root(output_dir: str, node: int, root: str) -> None:
    """For ``sailfin clean``."""
    _write_json(os.path.join(output_dir, f"{RECORD}{node}"), {"dir": root})


def run_identity(output_dir: str) -> str:
    """The run's identity: the id kept in ``output_dir`` (written now if it holds none)."""
    path = os.path.join(output_dir, IDENTITY)
    try:
        with open(path) as fh:
            found = json.load(fh).get("run")
        if isinstance(found, str) and found:
            return found
    except (OSError, ValueError, AttributeError):
        pass
    run = uuid.uuid4().hex[:16]
    _write_json(path, {"run": run})
    return run


def claim(root: str, rank: int, output_dir: str, run: str = "") -> None:
    """Say who writes in ``root``: a later run removes it only when they are all gone."""
    _write_json(os.path.join(root, f"owner-rank{rank:05d}.json"),
                {"host": socket.gethostname(), "pid": os.getpid(), "ppid": os.getppid(),
                 "output_dir": os.path.abspath(output_dir), "run": run})


def owners(root: str) -> list[dict[str, Any]]:
    """What the owner files in ``root`` say (none: no directory, or nobody claimed it)."""
    found = []
    for name in _names(root):
        if name.startswith("owner-rank") and name.endswith(".json"):
            try:
                with open(os.path.join(root, name)) as fh:
                    found.append(json.load(fh))
            except (OSError, ValueError):
                continue
    return found


def check_root(root: str, run: str, output_dir: str) -> tuple[Optional[str], list[str]]:
    """Before a run claims ``root``: (an error, the lines to say). Another run's snapshots
    whose writers are gone are removed; a writer that may be alive stops this run, which
    would otherwise write over (or resume from) what it is writing."""
    found = owners(root)
    alive = next((o for o in found if _writing(o)), None)
    if alive is not None:
        where = alive.get("output_dir", "?")
        same = alive.get("run") == run
        return (f"trainer.checkpoint.memory: {root} is in use by "
                + ("another process of this run" if same else f"the run writing {where}")
                + f" (pid {alive.get('pid')} on {alive.get('host')}, alive); "
                + ("stop it before restarting this run" if same else
                   "give this run its own trainer.checkpoint.memory.dir, or wait for that "
                   "run to end") + f" (sailfin clean {where} removes its snapshots)"), []
    if all(o.get("run") == run for o in found):
        return None, []
    shutil.rmtree(root, ignore_errors=True)
    mine = os.path.abspath(output_dir)
    whose = sorted({str(o.get("output_dir", "?")) for o in found if o.get("run") != run})
    why = ("written before this output directory was deleted and made again" if whose == [mine]
           else f"written by the run of {', '.join(w for w in whose if w != mine)}")
    return None, [f"memory snapshots: removed {root}: its snapshots belong to another run "
                  f"({why}, whose processes are gone) and are never resumed here"]


def _writing(owner: dict[str, Any]) -> bool:
    """Whether an owner may still be writing (on another host: this one cannot see)."""
    pid = int(owner.get("pid", 0))
    return owner.get("host") != socket.gethostname() or (
        pid > 1 and pid != os.getpid() and pid_alive(pid))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's
        pass
    return True


def is_dead(root: str) -> bool:
    """Whether every process that wrote in ``root`` (workers and launchers) is gone; not
    so for a directory without owners, or owned on another host."""
    found, host = owners(root), socket.gethostname()
    return bool(found) and all(o.get("host") == host for o in found) and not any(
        pid_alive(int(o[key])) for o in found for key in ("pid", "ppid")
        if int(o.get(key, 0)) > 1)


def remove_leftovers(parent: str, keep: str) -> list[str]:
    """Remove (and return) the snapshot directories under ``parent`` of dead runs."""
    removed = []
    for entry in sorted(_names(parent)):
        path = os.path.join(parent, entry)
        if (entry.startswith(PREFIX) and os.path.abspath(path) != os.path.abspath(keep)
                and is_dead(path)):  # (a file is never: it has no owners)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def free_bytes(path: str) -> int:
    """Free space of the file system holding ``path`` (or its nearest existing parent)."""
    while not os.path.exists(path):
        path = os.path.dirname(path) or "/"
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def used_bytes(path: str) -> int:
    total = 0
    for where, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(where, name))
            except OSError:
                pass
    return total


def clean(output_dir: str) -> list[str]:
    """``sailfin clean OUTPUT_DIR``: the run's snapshot directories on this machine, the
    default ones named after the run and those its record files name."""
    prefix = f"{PREFIX}{run_id(output_dir)}-node"
    roots = {os.path.join(DEFAULT_PARENT, e) for e in _names(DEFAULT_PARENT)
             if e.startswith(prefix)}
    for name in [e for e in _names(output_dir) if e.startswith(RECORD)]:
        try:
            with open(os.path.join(output_dir, name)) as fh:
                roots.add(json.load(fh)["dir"])
        except (OSError, ValueError, KeyError):
            pass
        os.remove(os.path.join(output_dir, name))
    removed = [root for root in sorted(roots) if os.path.isdir(root)]
    for root in removed:
        shutil.rmtree(root, ignore_errors=True)
    return removed


def read_manifest(path: str) -> dict[str, Any]:
    manifest_path = os.path.join(path, manifests.MANIFEST)
    with open(manifest_path, "rb") as fh:
        return manifests.decode(fh.read(), manifest_path)


def intact(path: str, world_size: Optional[int] = None, run: Optional[str] = None,
           verify: bool = True) -> Optional[dict[str, Any]]:
    """The manifest of the snapshot in ``path`` if every file matches it (and it was taken
    by the run ``run``, on ``world_size`` ranks unless it holds replicated state, which
    any world size resumes); else None. ``verify=False`` compares sizes only."""
    try:
        manifest = read_manifest(path)
        files = manifests.files_of(manifest, os.path.join(path, manifests.MANIFEST))
        about = manifest.get("memory_snapshot") or {}
        if world_size is not None and manifest.get("world_size") != world_size \
                and not about.get("replicated"):
            return None
        if run is not None and about.get("run") != run:
            return None
        if all((checksum_file(os.path.join(path, name)) == (entry.size, entry.crc32))
               if verify else os.path.getsize(os.path.join(path, name)) == entry.size
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
    ``keep_from``, its manifest removed, becomes its temporary directory (returned), whose
    files the writer rewrites in place: freeing and allocating pages costs as much as
    writing them."""
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
    """Rank -> step -> directory of every snapshot in the node's directory ``root`` (own
    or replica) that a rank of the run ``run`` can resume from (:func:`intact`, sizes
    only), its node copy here too when another rank wrote that."""
    found: dict[int, dict[int, tuple[str, Optional[int]]]] = {}
    for entry in sorted(_names(root)):  # own copies ("rank...") before replicas
        match = _RANK_DIR.match(entry)
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
    try:
        return os.listdir(directory)
    except OSError:
        return []
