"""Where memory snapshots live, who owns them, and removing them.

One directory per run and node, on a RAM file system::

    /dev/shm/sailfin-<run id>-node<N>/
        owner-rank00000.json          run identity, host, pid and launcher pid of a writer
        rank00000/step-00000012/      rank 0's newest complete snapshot
        rank00000/.tmp-step-00000013/ the one being written
        replica-rank00001/step-...    another node's rank 1, kept here (replicas: 1)

The directory's name is a hash of ``trainer.output_dir``: a restarted worker, a
relaunched job and ``sailfin clean OUTPUT_DIR`` all find the same directories. A
run records a custom ``dir`` in ``OUTPUT_DIR/.memory-snapshots-node<N>``.

Whose snapshots they are is not derived from a path: a run's identity is a
random id kept in ``OUTPUT_DIR/.memory-snapshots-run``, written when the run
first starts, and every snapshot and owner file records it. A snapshot is
resumed only by the run whose output directory holds its id: not after that
directory is gone (a new id), not by a run with another output directory that
shares ``memory.dir``, and not while a writer of the directory is alive.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import uuid
from typing import Any, Optional

DEFAULT_PARENT = "/dev/shm"
PREFIX = "sailfin-"
RECORD = ".memory-snapshots-node"
IDENTITY = ".memory-snapshots-run"


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
    os.makedirs(output_dir, exist_ok=True)
    run = uuid.uuid4().hex[:16]
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump({"run": run}, fh)
    os.replace(tmp, path)
    return run


def claim(root: str, rank: int, output_dir: str, run: str = "") -> None:
    """Say who writes in ``root``: a later run removes it only when they are all gone."""
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, f"owner-rank{rank:05d}.json")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump({"host": socket.gethostname(), "pid": os.getpid(), "ppid": os.getppid(),
                   "output_dir": os.path.abspath(output_dir), "run": run}, fh)
    os.replace(tmp, path)


def owners(root: str) -> list[dict[str, Any]]:
    """What the owner files in ``root`` say (none: no directory, or nobody claimed it)."""
    found = []
    try:
        names = os.listdir(root)
    except OSError:
        return found
    for name in names:
        if name.startswith("owner-rank") and name.endswith(".json"):
            try:
                with open(os.path.join(root, name)) as fh:
                    found.append(json.load(fh))
            except (OSError, ValueError):
                continue
    return found


def live_writer(found: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """An owner that may still be writing: its worker alive on this host, or on another
    host (which this one cannot see)."""
    host = socket.gethostname()
    for owner in found:
        pid = int(owner.get("pid", 0))
        if owner.get("host") != host or (pid > 1 and pid != os.getpid() and pid_alive(pid)):
            return owner
    return None


def check_root(root: str, run: str, output_dir: str) -> tuple[Optional[str], list[str]]:
    """Before a run claims ``root``: (an error, the lines to say). Another run's snapshots
    whose writers are gone are removed; a writer still alive stops this run, which would
    otherwise write over (or resume from) what a live process is writing."""
    found = owners(root)
    if not found:
        return None, []
    alive = live_writer(found)
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


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (someone else's counts)."""
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
    return not any(pid_alive(int(o[key])) for o in owners for key in ("pid", "ppid")
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
