"""Where memory snapshots live, who owns them, and removing them.

One directory per run and node, on a RAM file system::

    /dev/shm/sailfin-<run id>-node<N>/
        owner-rank00000.json          host, pid and launcher pid of the rank that wrote here
        rank00000/step-00000012/      rank 0's newest complete snapshot
        rank00000/.tmp-step-00000013/ the one being written
        replica-rank00001/step-...    another node's rank 1, kept here (replicas: 1)

The run id is a hash of ``trainer.output_dir``: a restarted worker, a relaunched
job and ``sailfin clean OUTPUT_DIR`` all find the same directories. A run
records a custom ``dir`` in ``OUTPUT_DIR/.memory-snapshots-node<N>``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from typing import Optional

DEFAULT_PARENT = "/dev/shm"
PREFIX = "sailfin-"
RECORD = ".memory-snapshots-node"


def run_id(output_dir: str) -> str:
    """A short, stable name for a run: the hash of its output directory's absolute path."""
    return hashlib.sha1(os.path.abspath(output_dir).encode("utf-8")).hexdigest()[:12]


def snapshot_root(dir_: Optional[str], output_dir: str, node: int) -> str:
    """This node's snapshot directory: ``dir_``, or one named after the run and node."""
    if dir_:
        return os.path.abspath(dir_)
    return os.path.join(DEFAULT_PARENT, f"{PREFIX}{run_id(output_dir)}-node{node}")


def record_root(output_dir: str, node: int, root: str) -> None:
    """Note the node's snapshot directory in the output dir, for ``sailfin clean``."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, f"{RECORD}{node}")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump({"dir": root}, fh)
    os.replace(tmp, path)


def claim(root: str, rank: int, output_dir: str) -> None:
    """Say who writes in ``root``: a later run removes it only when they are all gone."""
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, f"owner-rank{rank:05d}.json")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump({"host": socket.gethostname(), "pid": os.getpid(), "ppid": os.getppid(),
                   "output_dir": os.path.abspath(output_dir)}, fh)
    os.replace(tmp, path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_dead(root: str) -> bool:
    """Whether every process that wrote in ``root`` (its workers and their launcher, on
    this host) is gone. A directory without owners, or owned on another host, is not dead."""
    owners = []
    for name in os.listdir(root):
        if name.startswith("owner-rank") and name.endswith(".json"):
            try:
                with open(os.path.join(root, name)) as fh:
                    owners.append(json.load(fh))
            except (OSError, ValueError):
                continue
    if not owners:
        return False
    host = socket.gethostname()
    if any(o.get("host") != host for o in owners):
        return False
    return not any(_alive(int(o[key])) for o in owners for key in ("pid", "ppid")
                   if int(o.get(key, 0)) > 1)


def remove_leftovers(parent: str, keep: str) -> list[str]:
    """Remove the snapshot directories under ``parent`` whose runs are dead (their RAM
    comes back); never ``keep``, this run's own. Returns what was removed."""
    removed = []
    try:
        entries = sorted(os.listdir(parent))
    except OSError:
        return removed
    for entry in entries:
        path = os.path.join(parent, entry)
        if not entry.startswith(PREFIX) or os.path.abspath(path) == os.path.abspath(keep):
            continue
        try:
            dead = os.path.isdir(path) and is_dead(path)
        except OSError:
            continue
        if dead:
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
    """Bytes of the files under ``path``."""
    total = 0
    for where, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(where, name))
            except OSError:
                pass
    return total


def clean(output_dir: str) -> list[str]:
    """Remove a run's snapshot directories on this machine (``sailfin clean OUTPUT_DIR``):
    the default ones named after the run, and those its record files name."""
    roots = set()
    try:
        entries = os.listdir(DEFAULT_PARENT)
    except OSError:
        entries = []
    prefix = f"{PREFIX}{run_id(output_dir)}-node"
    roots.update(os.path.join(DEFAULT_PARENT, e) for e in entries if e.startswith(prefix))
    try:
        records = [e for e in os.listdir(output_dir) if e.startswith(RECORD)]
    except OSError:
        records = []
    for name in records:
        try:
            with open(os.path.join(output_dir, name)) as fh:
                roots.add(json.load(fh)["dir"])
        except (OSError, ValueError, KeyError):
            pass
        os.remove(os.path.join(output_dir, name))
    removed = []
    for root in sorted(roots):
        if os.path.isdir(root):
            shutil.rmtree(root, ignore_errors=True)
            removed.append(root)
    return removed


def clean_command(output_dir: str) -> int:
    """``sailfin clean OUTPUT_DIR``: remove the run's snapshots here, say what went."""
    removed = clean(output_dir)
    for path in removed:
        print(f"removed {path}")
    print(f"sailfin clean: {len(removed)} memory snapshot director"
          f"{'y' if len(removed) == 1 else 'ies'} of {output_dir} removed")
    return 0
