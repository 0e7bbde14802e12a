"""Where memory snapshots live, whose they are, and how they travel between ranks: run
identity, owners, leftovers of dead runs, free space, ``sailfin clean``, the ranks'
agreement and replicas.

One directory per run and node, on a RAM file system::

    /dev/shm/sailfin-<hash of output_dir>-node<N>/
        owner-rank00000.json     run identity, host, pid and launcher pid of a rank
        rank00000/               rank 0's two buffer sets (:mod:`.snapshots`)
        replica-rank00001/       another node's rank 1, kept here (replicas: 1)

The directory's name is a hash of ``trainer.output_dir``, so that a restarted worker, a
relaunched job and ``sailfin clean OUTPUT_DIR`` find it; a custom ``dir`` is recorded in
``OUTPUT_DIR/.memory-snapshots-node<N>``. Whose snapshots a run may resume:
docs/memory-snapshots.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import uuid
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from ..utils.files import replace_file

if TYPE_CHECKING:
    from .snapshot_sets import Location

DEFAULT_PARENT = "/dev/shm"
PREFIX = "sailfin-"
RECORD = ".memory-snapshots-node"
IDENTITY = ".memory-snapshots-run"


def write_json(path: str, obj: Any) -> None:
    """``obj`` as JSON in ``path``, whole or not at all (a rename; no fsync: RAM)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    replace_file(path, json.dumps(obj).encode("utf-8"), durable=False)


def names(directory: str) -> list[str]:
    """The entries of ``directory``; none when it is missing or unreadable."""
    try:
        return os.listdir(directory)
    except OSError:
        return []


def remove_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def run_id(output_dir: str) -> str:
    """The hash of the output directory's absolute path."""
    return hashlib.sha1(os.path.abspath(output_dir).encode("utf-8")).hexdigest()[:12]


def snapshot_root(dir_: Optional[str], output_dir: str, node: int) -> str:
    """This node's snapshot directory: ``dir_``, or one named after the run and node."""
    if dir_:
        return os.path.abspath(dir_)
    return os.path.join(DEFAULT_PARENT, f"{PREFIX}{run_id(output_dir)}-node{node}")


def record_root(output_dir: str, node: int, root: str) -> None:
    """For ``sailfin clean``."""
    write_json(os.path.join(output_dir, f"{RECORD}{node}"), {"dir": root})


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
    write_json(path, {"run": run})
    return run


def claim(root: str, rank: int, output_dir: str, run: str = "") -> None:
    """Say who writes in ``root``: a later run removes it only when they are all gone."""
    write_json(os.path.join(root, f"owner-rank{rank:05d}.json"),
               {"host": socket.gethostname(), "pid": os.getpid(), "ppid": os.getppid(),
                "output_dir": os.path.abspath(output_dir), "run": run})


def owners(root: str) -> list[dict[str, Any]]:
    """What the owner files in ``root`` say (none: no directory, or nobody claimed it)."""
    found = []
    for name in names(root):
        if name.startswith("owner-rank") and name.endswith(".json"):
            try:
                with open(os.path.join(root, name)) as fh:
                    found.append(json.load(fh))
            except (OSError, ValueError):
                continue
    return found


def check_root(root: str, run: str, output_dir: str) -> tuple[Optional[str], list[str]]:
    """Before a run claims ``root``: (an error, the lines to say). Another run's snapshots
    whose processes are gone are removed; a process that may be alive stops this run,
    which would otherwise write over (or resume from) what it is writing."""
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
    for entry in sorted(names(parent)):
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
    """Bytes of the files under ``path``."""
    total = 0
    for where, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(where, name))
    return total


def clean(output_dir: str) -> list[str]:
    """``sailfin clean OUTPUT_DIR``: the run's snapshot directories on this machine, the
    default ones named after the run and those its record files name."""
    prefix = f"{PREFIX}{run_id(output_dir)}-node"
    roots = {os.path.join(DEFAULT_PARENT, e) for e in names(DEFAULT_PARENT)
             if e.startswith(prefix)}
    for name in [e for e in names(output_dir) if e.startswith(RECORD)]:
        try:
            with open(os.path.join(output_dir, name)) as fh:
                roots.add(json.load(fh)["dir"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        remove_file(os.path.join(output_dir, name))
    removed = [root for root in sorted(roots) if os.path.isdir(root)]
    for root in removed:
        shutil.rmtree(root, ignore_errors=True)
    return removed


class Peers:
    """Agreement between the ranks, and the groups snapshots travel on (gloo, whatever the
    training backend; nothing on one process).

    Example (on every rank)::

        peers = Peers(world_size)
        peers.start()
        if peers.min_pair(1 if ok else 0, step)[0] == 0:
            raise RuntimeError("a rank failed")
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.group: Any = None  # agreements and resume's transfers
        self.background: Any = None  # the snapshot thread's replicas

    def start(self) -> None:
        """Create the groups (a collective: every rank calls it at the same point)."""
        if self.world_size > 1 and self.group is None and dist.is_initialized():
            self.group = dist.new_group(backend="gloo")
            self.background = dist.new_group(backend="gloo")

    def min_pair(self, first: int, second: int) -> tuple[int, int]:
        """The smallest of every rank's ``first``, and of every rank's ``second``."""
        if self.group is None:
            return first, second
        box = torch.tensor([first, second], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self.group)
        return int(box[0]), int(box[1])

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


def exchange(group: Any, out: Optional["Location"], dst: Optional[int], src: Optional[int],
             into: Optional["Location"]) -> Optional[int]:
    """Send the set ``out`` to ``dst`` (None: nothing, this rank dropped it) while
    receiving ``src``'s into the set ``into``, each byte once: from the sender's pages
    to the receiver's. Returns the step received (None: none). The header comes last."""
    header = b""
    if out is not None:
        with open(out.path("json"), "rb") as fh:
            header = fh.read()
    length = torch.zeros(1, dtype=torch.int64)
    _move(group, [torch.tensor([len(header)], dtype=torch.int64)], dst, [length], src)
    got = torch.empty(int(length.item()), dtype=torch.uint8)
    _move(group, [torch.frombuffer(bytearray(header), dtype=torch.uint8)] if header else [],
          dst, [got], src)
    outgoing = [torch.from_file(out.path(ext), shared=False, size=n, dtype=torch.uint8)
                for ext, n in _sizes(json.loads(header)) if n] if out is not None else []
    incoming = json.loads(got.numpy().tobytes().decode("utf-8")) if got.numel() else None
    targets = []
    if incoming is not None and into is not None:
        os.makedirs(into.directory, exist_ok=True)
        remove_file(into.path("json"))
        for ext, n in _sizes(incoming):
            fd = os.open(into.path(ext), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:  # reserved: a full file system is an error here, not a SIGBUS later
                if n:
                    os.posix_fallocate(fd, 0, n)
            finally:
                os.close(fd)
            if n:
                targets.append(torch.from_file(into.path(ext), shared=True, size=n,
                                               dtype=torch.uint8))
    _move(group, outgoing, dst, targets, src)
    if incoming is None or into is None:
        return None
    write_json(into.path("json"), incoming)  # the commit
    return int(incoming["step"])


def _sizes(header: dict[str, Any]) -> list[tuple[str, int]]:
    if not header:
        return []
    about = header["memory_snapshot"]
    return [("pt", int(about["state"][0])), ("bin", int(about["tensors"][0]))]


def _move(group: Any, out: list[torch.Tensor], dst: Optional[int], into: list[torch.Tensor],
          src: Optional[int]) -> None:
    """Send ``out`` to ``dst`` while receiving ``into`` from ``src``, empty ones not at all."""
    requests = [dist.isend(t, dst, group=group) for t in out if dst is not None and t.numel()]
    requests += [dist.irecv(t, src, group=group) for t in into
                 if src is not None and t.numel()]
    for request in requests:
        request.wait()
