"""Resuming from memory snapshots: the ranks agree on the newest step all of them hold.

fsdp state is kept in a snapshot as each rank's own rows (:func:`local_shards`): a
snapshot is resumed on the same ranks that wrote it, so a DTensor is kept as its local
rows plus its global shape, stride and placements, and rebuilt on the same device mesh.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Optional

import torch

from ..config.trainer import TrainerArguments
from ..distributed import DistEnv
from ..logging.destination import check_directory
from ..utils.voice import say
from . import memory_dirs, memory_transfer
from .checkpointer import Checkpointer, Loaded
from .errors import CheckpointError
from .memory import MemoryStore
from .memory_dirs import step_name

PREFIX = "memory:"
_DISK_STEP = re.compile(r"step-(\d+)$")
MARK = "__sailfin_dtensor__"


class MemoryFirstCheckpointer(Checkpointer):
    """The run's checkpointer (saves go to it), with the newest memory snapshot every rank
    holds first in line for ``resume: auto`` when it is at least as new as the newest disk
    checkpoint.

    Example::

        ckpt = MemoryFirstCheckpointer(DirectoryCheckpointer(dir, args, dist), store,
                                       output_dir="outputs/run")
        ckpt.recover()                 # every rank: agree on a step, fetch lost replicas
        ckpt.candidates()              # ["memory:step-00000012", "step-00000008", ...]
    """

    def __init__(self, inner: Checkpointer, store: MemoryStore, output_dir: str,
                 resume: str = "auto") -> None:
        super().__init__(inner.location, inner.args, inner.dist, inner.barrier)
        self.inner, self.store = inner, store
        self.output_dir = output_dir
        self.resume = resume  # only resume: auto resumes from memory
        self.writes_shards = getattr(inner, "writes_shards", False)
        # step -> (this rank's snapshot dir, what resuming from it says)
        self._agreed: dict[int, tuple[str, str]] = {}
        self.mesh: Any = None  # fsdp: the model's device mesh, to rebuild shards on

    def save(self, snapshot: Any) -> None:
        self.inner.save(snapshot)

    def latest(self) -> Optional[str]:
        return self.inner.latest()

    def wait(self) -> None:
        self.inner.wait()

    def settle(self) -> bool:
        return self.inner.settle()

    def abort(self) -> None:
        self.inner.abort()

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            self.store.close()

    def candidates(self) -> list[str]:
        memory = [f"{PREFIX}{step_name(s)}" for s in sorted(self._agreed, reverse=True)]
        return memory + self.inner.candidates()

    def recover(self) -> None:
        """Every rank: learn the run's identity, make sure the node's directory is this
        run's (:func:`.memory_dirs.check_root`), claim it, and with ``resume: auto`` agree
        on the snapshot to resume from."""
        self.inner.recover()
        store = self.store
        store.peers.start()
        store.run = store.peers.all_gather(
            memory_dirs.run_identity(self.output_dir) if store.rank == 0 else None)[0]
        verdict = (memory_dirs.check_root(store.root, store.run, self.output_dir)
                   if store.local_rank == 0 else (None, []))
        verdicts = store.peers.all_gather(verdict)  # before any rank claims the directory
        for line in verdict[1]:  # each node's own: said there
            say(line, warning=True)
        refused = next((error for error, _ in verdicts if error), None)
        if refused:
            raise CheckpointError(refused)
        memory_dirs.claim(store.root, store.rank, self.output_dir, store.run)
        store.start_writer()  # it imports torch while the run sets up
        if store.local_rank == 0:
            memory_dirs.record_root(self.output_dir, store.node, store.root)
            for path in memory_dirs.remove_leftovers(os.path.dirname(store.root), store.root):
                say(f"removed the memory snapshots of a run that is gone: {path}",
                    warning=True)
        # resume: never (or a path) starts elsewhere; this run's snapshots go at its start.
        self._agreed = self._agree() if self.resume == "auto" else {}

    def start_afresh(self) -> str:
        disk = self.inner.start_afresh() if self.inner.latest() is not None else ""
        return (f"{disk} and " if disk else "") + (
            f"run `sailfin clean {self.output_dir}` (its memory snapshots in "
            f"{self.store.root})")

    def _agree(self) -> dict[int, tuple[str, str]]:
        """The two newest steps every rank holds, not older than the newest disk checkpoint
        (step -> this rank's snapshot directory, what resuming from it says); ranks whose
        node lost one get the replica. The second is for when the first's CRC-32s fail."""
        store, rank, world = self.store, self.store.rank, self.store.world_size
        mine = store.inventory()
        reports = store.peers.all_gather({r: sorted(s) for r, s in mine.items()})
        held = {r: set().union(*(report.get(r, []) for report in reports))
                for r in range(world)}
        newest = max((s for steps in held.values() for s in steps), default=None)
        if newest is None:
            return {}
        common = set.intersection(*held.values())
        disk = self._disk_step()
        if not common:
            if rank == 0:
                lost = [str(r) for r, steps in held.items() if not steps]
                lost_ranks = ", ".join(lost[:8]) + (" ..." if len(lost) > 8 else "")
                say(f"memory snapshots: no step is held for every rank (rank(s) "
                    f"{lost_ranks or 'all'} lack one: their node's memory was lost and no "
                    f"replica holds it, or the world size changed); resuming from "
                    f"{'disk step ' + str(disk) if disk is not None else 'the start'}, "
                    f"{newest - (disk or 0)} step(s) behind the newest snapshot (step {newest})")
            return {}
        steps = sorted((s for s in common if disk is None or s >= disk), reverse=True)[:2]
        if not steps:
            if rank == 0:
                say(f"memory snapshots: the newest common step {max(common)} is older than the "
                    f"disk checkpoint of step {disk}; resuming from disk")
            return {}
        agreed = {}
        for step in steps:
            fetched = []
            for r in range(world):  # the same order on every rank: pairs never deadlock
                if step in reports[r].get(r, []):
                    continue
                holder = min(q for q in range(world) if step in reports[q].get(r, []))
                fetched.append((r, holder))
                if rank == holder:
                    memory_transfer.send(store.peers.group, mine[r][step], r)
                elif rank == r:
                    mine.setdefault(r, {})[step] = memory_transfer.recv(
                        store.peers.group, holder, store.own_dir(), step)
            if fetched:
                store.peers.min(0)  # every copy is back before a rank reads its node's copy
            via = "; ".join(f"rank {r} from the replica held by rank {h}" for r, h in fetched)
            agreed[step] = (mine[rank][step], (
                f"memory snapshots: resuming from memory, step {step} (held by every rank"
                + (f"; {via}, its node's memory being lost" if via else "")
                + f"); newest snapshot step {newest}, newest disk checkpoint "
                + (f"step {disk}" if disk is not None else "none")))
        return agreed

    def _disk_step(self) -> Optional[int]:
        names = self.inner.candidates()
        match = _DISK_STEP.search(names[0]) if names else None
        return int(match.group(1)) if match else (None if not names else -1)

    def load(self, name: str) -> Loaded:
        if not name.startswith(PREFIX):
            return self.inner.load(name)
        step = int(name.rsplit("-", 1)[1])
        path, note = self._agreed.pop(step)  # resumed (or skipped): no longer a candidate
        manifest, shared, rank_state = self.store.load(path)  # checks the CRC-32s
        if self.store.rank == 0:
            say(note)
        return Loaded(name, path, manifest, global_shards(shared, self.mesh), rank_state)


def with_memory_snapshots(inner: Checkpointer, args: TrainerArguments,
                          dist: DistEnv) -> Checkpointer:
    """``inner`` with memory snapshots when ``trainer.checkpoint.memory.every_n_steps`` is set."""
    memory = args.checkpoint.memory
    if not memory.enabled:
        return inner
    node = dist.rank // dist.local_world_size
    root = memory_dirs.snapshot_root(memory.dir, args.output_dir, node)
    # A file in the way, a read-only or full file system: one line before the first step.
    check_directory(memory.dir or memory_dirs.DEFAULT_PARENT, "memory snapshot",
                    key="trainer.checkpoint.memory.dir",
                    who="memory snapshots (trainer.checkpoint.memory)")
    store = MemoryStore(root, dist.rank, dist.world_size, dist.local_world_size,
                        memory.replicas, dist.local_rank)
    if memory.replicas and store.replica_dst is None and dist.is_main:
        say("trainer.checkpoint.memory.replicas is 1 but the job runs on one node: there "
            "is no other node to keep replicas; a lost node resumes from disk")
    return MemoryFirstCheckpointer(inner, store, args.output_dir, args.resume)


def persisting_args(args: TrainerArguments) -> Any:
    """The disk checkpointer's settings: with ``persist_every_n_steps`` saves are async."""
    ckpt = args.checkpoint
    if ckpt.memory.enabled and ckpt.memory.persist_every_n_steps and not ckpt.async_save:
        return dataclasses.replace(ckpt, async_save=True)
    return ckpt


def local_shards(state: Any) -> Any:
    """``state`` with every DTensor replaced by a plain dict holding its local rows
    (``state`` itself when it holds none)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def local(value: Any) -> Any:
        if not isinstance(value, DTensor):
            return value
        placements = []
        for p in value.placements:
            if not isinstance(p, (Shard, Replicate)):
                raise ValueError(f"memory snapshots cannot keep a DTensor placed as {p}")
            placements.append(["shard", p.dim] if isinstance(p, Shard) else ["replicate"])
        return {MARK: value.to_local(), "shape": list(value.shape),
                "stride": list(value.stride()), "placements": placements}

    return _replace(state, local)


def global_shards(state: Any, mesh: Optional[Any]) -> Any:
    """Undo :func:`local_shards` on ``mesh`` (the model's device mesh)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def rebuilt(value: Any) -> Any:
        if not (isinstance(value, dict) and MARK in value):
            return value
        if mesh is None:
            raise ValueError("the memory snapshot holds fsdp shards but this run's model is "
                             "not sharded")
        placements = [Shard(int(p[1])) if p[0] == "shard" else Replicate()
                      for p in value["placements"]]
        return DTensor.from_local(value[MARK].to(mesh.device_type), mesh, placements,
                                  run_check=False, shape=torch.Size(value["shape"]),
                                  stride=tuple(value["stride"]))

    return _replace(state, rebuilt)


def _replace(state: Any, convert: Any) -> Any:
    """``state`` with ``convert`` applied to each value, through dicts, lists and tuples;
    a container in which nothing changed is kept as it is."""
    done = convert(state)
    if done is not state:
        return done
    if isinstance(state, dict):
        new = {k: _replace(v, convert) for k, v in state.items()}
        return new if any(new[k] is not v for k, v in state.items()) else state
    if type(state) in (list, tuple):
        items = [_replace(v, convert) for v in state]
        return type(state)(items) if any(a is not b for a, b in zip(items, state)) else state
    return state
