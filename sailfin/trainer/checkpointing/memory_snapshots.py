"""``trainer.checkpoint.memory``: a snapshot of the trainer's state in shared memory every
N steps, and resuming from the newest step every rank holds.

The storage is :mod:`sailfin.checkpoint.snapshots`; this callback decides when, hands it
the state, waits for the copy before each optimizer step, checks before the first step
that two snapshots fit, persists every ``persist_every_n_steps`` as an ordinary
checkpoint, and removes the snapshots when the run ends normally. On resume the ranks
agree on the step to continue from (:meth:`MemorySnapshots.recover`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from ...checkpoint import CheckpointError, Checkpointer, Loaded, snapshot_dirs
from ...checkpoint.rng import rng_state
from ...checkpoint.snapshot_dirs import exchange
from ...checkpoint.snapshot_layout import global_shards, is_tensor, local_shards, map_tree
from ...checkpoint.snapshot_sets import Encoded, Location
from ...checkpoint.snapshots import SnapshotStore
from ...config.trainer import TrainerArguments
from ...logging.destination import check_directory
from ...utils.voice import say
from ..core.callbacks import Callback, notify_save_end
from .saver import CheckpointCallback, manifest_facts

if TYPE_CHECKING:
    from ..core.view import RunView

StepHook = Callable[[int, Any, Any], None]  # (global_step, loss, stats): on_end_train_step
PREFIX = "memory:"  # a snapshot's name among the checkpoints to resume
_DISK_STEP = re.compile(r"step-(\d+)$")
_FILE_OVERHEAD = 1 << 16  # a set's .pt and header, generously


class MemorySnapshots(Callback):
    """Snapshots every ``every_n_steps`` optimizer steps. ``stall_seconds`` records how
    long each held training (its copy now, and the wait for the rest of it before the
    next optimizer step).

    Example::

        args = TrainerArguments(checkpoint={"memory": {"every_n_steps": 1}})
        Trainer(module, args).train()   # the trainer adds this callback itself
    """

    def __init__(self, store: SnapshotStore, args: TrainerArguments,
                 saver: CheckpointCallback) -> None:
        self.store, self.args = store, args
        memory = args.checkpoint.memory
        self.every = memory.every_n_steps if isinstance(memory.every_n_steps, int) else 1
        self.persist = memory.persist_every_n_steps
        self.saver = saver  # persisting is an ordinary (async) save; it has the best metric
        self.stall_seconds: list[float] = []
        self.copy_waits: list[float] = []  # a step waited for the copy (seconds)
        self.snapshot_bytes = 0  # one rank's whole snapshot state, as counted before step 1
        self.overlap = True  # copy the stepped state during the next forward and backward
        self.mesh: Any = None  # fsdp: the model's device mesh, to rebuild shards on
        self._config: Optional[Encoded] = None  # trainer.args as JSON, for every snapshot
        self._agreed: dict[int, tuple[Any, str]] = {}  # step -> (set, what resuming says)

    # -- resume ------------------------------------------------------------------
    def recover(self, trainer: "RunView", disk: list[str]) -> list[str]:
        """Every rank, before resuming: learn the run's identity, make sure the node's
        directory is this run's, claim it, and with ``resume: auto`` agree on the steps to
        resume from (names newest first; ``disk``: the disk checkpoints, newest first)."""
        store, output_dir = self.store, self.args.output_dir
        store.peers.start()
        store.run = store.peers.all_gather(
            snapshot_dirs.run_identity(output_dir) if store.rank == 0 else None)[0]
        verdict = (snapshot_dirs.check_root(store.root, store.run, output_dir)
                   if store.local_rank == 0 else (None, []))
        verdicts = store.peers.all_gather(verdict)  # before any rank claims the directory
        for line in verdict[1]:  # each node's own: said there
            say(line, warning=True)
        refused = next((error for error, _ in verdicts if error), None)
        if refused:
            raise CheckpointError(refused)
        snapshot_dirs.claim(store.root, store.rank, output_dir, store.run)
        if store.local_rank == 0:
            snapshot_dirs.record_root(output_dir, store.node, store.root)
            for path in snapshot_dirs.remove_leftovers(os.path.dirname(store.root), store.root):
                say(f"removed the memory snapshots of a run that is gone: {path}", warning=True)
        match = _DISK_STEP.search(disk[0]) if disk else None
        disk_step = int(match.group(1)) if match else (-1 if disk else None)
        # resume: never (or a path) starts elsewhere; this run's snapshots go at its start.
        self._agreed = self._agree(disk_step) if self.args.resume == "auto" else {}
        return [f"{PREFIX}step-{s:08d}" for s in sorted(self._agreed, reverse=True)]

    def _agree(self, disk: Optional[int]) -> dict[int, tuple[Any, str]]:
        """The two newest steps every rank holds, not older than the newest disk checkpoint;
        ranks whose node lost one get the replica. The second is for when the first fails
        its checks."""
        store, rank, world = self.store, self.store.rank, self.store.world_size
        mine = store.inventory()
        reports = store.peers.all_gather({r: sorted(s) for r, s in mine.items()})
        held = {r: set().union(*(report.get(r, []) for report in reports)) for r in range(world)}
        newest = max((s for steps in held.values() for s in steps), default=None)
        if newest is None:
            if rank == 0 and disk is not None:
                say(f"memory snapshots: none is held (removed at the run's last normal end, "
                    f"lost with its node's memory, or the run stopped before its first one "
                    f"since it last started); resuming from disk step {disk}")
            return {}
        common = set.intersection(*held.values())
        if not common:
            if rank == 0:
                lost = [str(r) for r, steps in held.items() if not steps]
                shown = ", ".join(lost[:8]) + (" ..." if len(lost) > 8 else "")
                say(f"memory snapshots: no step is held for every rank (rank(s) "
                    f"{shown or 'all'} lack one: their node's memory was lost and no "
                    f"replica holds it, or the world size changed); resuming from "
                    f"{'disk step ' + str(disk) if disk is not None else 'the start'}, "
                    f"{newest - (disk or 0)} step(s) behind the newest snapshot (step {newest})")
            return {}
        steps = sorted((s for s in common if disk is None or s >= disk), reverse=True)[:2]
        if not steps and rank == 0:
            say(f"memory snapshots: the newest common step {max(common)} is older than the "
                f"disk checkpoint of step {disk}; resuming from disk")
        agreed = {}
        for step in steps:
            fetched = []
            for r in range(world):  # the same order on every rank: pairs never deadlock
                if step in reports[r].get(r, []):
                    continue
                holder = min(q for q in range(world) if step in reports[q].get(r, []))
                fetched.append((r, holder))
                if rank == holder:
                    exchange(store.peers.group, mine[r][step], r, None, None)
                elif rank == r:
                    where = next(w for w in (Location(store.own_dir(), n) for n in "ab")
                                 if w not in mine.get(r, {}).values())
                    exchange(store.peers.group, None, None, holder, where)
                    mine.setdefault(r, {})[step] = where
            if fetched:
                store.peers.min_pair(0, 0)  # every copy is back before a rank reads its own
            via = "; ".join(f"rank {r} from the replica held by rank {h}" for r, h in fetched)
            agreed[step] = (mine[rank][step], (
                f"memory snapshots: resuming from memory, step {step} (held by every rank"
                + (f"; {via}, its node's memory being lost" if via else "")
                + f"); newest snapshot step {newest}, newest disk checkpoint "
                + (f"step {disk}" if disk is not None else "none")))
        return agreed

    def load(self, name: str) -> Loaded:
        """The snapshot ``name`` (one :meth:`recover` returned), every check done."""
        where, note = self._agreed.pop(int(name.rsplit("-", 1)[1]))  # no longer a candidate
        header, shared, rank_state = self.store.load(where)
        if self.store.rank == 0:
            say(note)
        return Loaded(name, str(where), header, global_shards(shared, self.mesh), rank_state)

    # -- training ----------------------------------------------------------------
    def on_train_start(self, trainer: "RunView") -> None:
        # What a run before this one left (newer steps above all) must never be resumed.
        self.store.keep_only(trainer.global_step)
        self.check_space(trainer)

    def on_step_end(self, trainer: "RunView") -> None:
        step = trainer.global_step
        if step % self.every == 0:
            self.snapshot(trainer)
        if self.persist and step % self.persist == 0:
            self.saver.save(trainer)  # skipped when a step save of the same step just ran

    def snapshot(self, trainer: "RunView") -> None:
        started = time.perf_counter()
        # Never commit weights a non-finite loss spoiled: the snapshot thread reads this
        # rank's unread losses (no sync, no collective here); a rank that found one never
        # commits the step, so it is never one every rank holds. The guard names the step
        # at its next sync point.
        finite = trainer.nonfinite.all_finite()
        trainer.writers.flush()  # metrics.jsonl holds every event up to the snapshot
        state = trainer.state_dict()
        if self._config is None:  # as the manifests hold it; the run's does not change
            self._config = Encoded(json.dumps(dataclasses.asdict(trainer.args),
                                              sort_keys=True))
        facts = {**manifest_facts(trainer, self.saver, state, {}), "config": self._config}
        # fsdp: this rank's rows, as plain tensors (no model mesh: nothing is sharded)
        local = local_shards(state) if self.mesh is not None else state
        shared = {"model": local.pop("module"), "trainer": local}
        later = (lambda: stepped_state(trainer)) if self.overlap else None
        self.store.take(trainer.global_step, facts, shared, rng_state(), local is state, later,
                        finite)
        self.stall_seconds.append(time.perf_counter() - started)
        if not self.store.copying:  # else said once the copy is settled, with its wait
            notify_save_end(trainer, "snapshot", self.stall_seconds[-1])  # the time account

    def on_backward_end(self, trainer: "RunView", samples: int) -> bool:
        self.settle(trainer)  # before the optimizer step changes what is being copied
        return False

    def before_log(self, trainer: "RunView", then: Optional[StepHook]) -> Optional[StepHook]:
        """The trainer's ``on_end_train_step`` (``then`` the recipe's): a step is logged
        once the snapshot before it is committed, so a kill loses at most
        ``every_n_steps`` steps (the commit follows the copy within microseconds)."""
        def step_done(global_step: int, loss: Any, stats: Any) -> None:
            self.store.committed.wait()
            if then is not None:
                then(global_step, loss, stats)

        return step_done

    def settle(self, trainer: "RunView") -> None:
        started = time.perf_counter()
        unchanged = self.store.settle()
        if unchanged is None:
            return
        seconds = time.perf_counter() - started
        self.stall_seconds[-1] += seconds
        if self.store.busy:
            self.copy_waits.append(seconds)
        notify_save_end(trainer, "snapshot", self.stall_seconds[-1])
        if not unchanged and self.overlap:
            self.overlap = False
            say(f"memory snapshots: rank {trainer.dist.rank}'s parameters or optimizer "
                f"state changed between step {trainer.global_step}'s end and the next "
                "optimizer step (a forward that changes its weights in place, such as "
                "nn.Embedding(max_norm=...), or a callback): that snapshot is dropped, and "
                "from now on each snapshot is copied before training goes on", warning=True)

    def on_train_end(self, trainer: "RunView") -> None:
        self.settle(trainer)
        if self.copy_waits and trainer.dist.is_main:
            say(f"memory snapshots: {len(self.copy_waits)} of {len(self.stall_seconds)} "
                f"waited {sum(self.copy_waits):.1f} s in all for the copy of the parameters "
                "and optimizer state (slower than a forward and backward); a larger "
                "trainer.checkpoint.memory.every_n_steps leaves it more time")
        # The final state is on disk (the saver's on_train_end ran first): the RAM goes back.
        self.store.remove_mine()
        self.store.close()
        trainer.backend.barrier()
        if self.store.local_rank == 0:
            shutil.rmtree(self.store.root, ignore_errors=True)
            snapshot_dirs.remove_file(os.path.join(trainer.args.output_dir,
                                                   f"{snapshot_dirs.RECORD}{self.store.node}"))

    def check_space(self, trainer: "RunView") -> None:
        """Two sets per rank (and two replicas), the optimizer's state counted as after the
        first step, must fit each node's free shared memory; else stop before the first
        step, on every rank. Replicated state is copied once per node, each rank of it
        copying a share (at most an even share and the largest storage)."""
        state = trainer.state_dict()
        local = local_shards(state)
        grown = sum(max(0, stepped_state_bytes(opt) - state_bytes(dict(_inner(opt).state)))
                    for opt in trainer.optimizers)
        shared = state_bytes(local) + grown
        own = state_bytes(rng_state()) + _FILE_OVERHEAD
        self.snapshot_bytes = shared + own
        store = self.store
        replicas = store.replica_dst is not None
        ranks = store.local_world_size
        if local is state and ranks > 1:  # the same on every rank: shared by the node's
            largest = max(storage_sizes(local).values(), default=0)
            shared = min(shared, -(-shared // ranks) + largest)
        writes = shared + own
        root = store.root
        free = snapshot_dirs.free_bytes(root) + snapshot_dirs.used_bytes(root)
        reports = store.peers.all_gather((store.node, writes, free, root))
        for where in sorted({r[0] for r in reports}):
            on_node = [r for r in reports if r[0] == where]
            need = sum(r[1] * 2 * (1 + replicas) for r in on_node)
            free, root = on_node[0][2], on_node[0][3]
            if need <= free:
                continue
            raise CheckpointError(
                f"trainer.checkpoint.memory: snapshots need {_mb(need)} on node {where} "
                f"(2 buffer sets" + (" and 2 replicas" if replicas else "")
                + f" of {_mb(max(r[1] for r in on_node))} at most per rank, model and "
                f"optimizer state once per node, {len(on_node)} rank(s)) but {root} has "
                f"{_mb(free)} free; enlarge /dev/shm (docker run --shm-size), point "
                "trainer.checkpoint.memory.dir at a larger tmpfs"
                + (", set trainer.checkpoint.memory.replicas: 0" if replicas else "")
                + ", or turn snapshots off (trainer.checkpoint.memory.every_n_steps: null)")


def memory_snapshot_callback(checkpointer: Checkpointer, args: TrainerArguments,
                             saver: Optional[CheckpointCallback],
                             module: torch.nn.Module) -> list[MemorySnapshots]:
    """The callback ``trainer.checkpoint.memory`` asks for (none when it is off)."""
    memory, dist = args.checkpoint.memory, checkpointer.dist
    if not memory.enabled:
        return []
    # Persisting is an ordinary (async) save; the saver also supplies the best metric.
    saver = saver or CheckpointCallback(checkpointer, args.checkpoint)
    # A file in the way, a read-only or full file system: one line before the first step.
    check_directory(memory.dir or snapshot_dirs.DEFAULT_PARENT, "memory snapshot",
                    key="trainer.checkpoint.memory.dir",
                    who="memory snapshots (trainer.checkpoint.memory)")
    root = snapshot_dirs.snapshot_root(memory.dir, args.output_dir,
                                       dist.rank // dist.local_world_size)
    store = SnapshotStore(root, dist.rank, dist.world_size, dist.local_world_size,
                          memory.replicas, dist.local_rank)
    if memory.replicas and store.replica_dst is None and dist.is_main:
        say("trainer.checkpoint.memory.replicas is 1 but the job runs on one node: there "
            "is no other node to keep replicas; a lost node resumes from disk")
    if memory.every_n_steps == "auto":  # chosen from measurements
        from .auto_interval import AutoMemorySnapshots
        callback: MemorySnapshots = AutoMemorySnapshots(store, args, saver)
    else:
        callback = MemorySnapshots(store, args, saver)
    callback.mesh = next((p.device_mesh for p in module.parameters()  # fsdp's DTensors
                          if hasattr(p, "device_mesh")), None)
    return [callback]


def snapshots_of(trainer: "RunView") -> Optional[MemorySnapshots]:
    """The run's memory snapshots, if it takes them."""
    return next((c for c in trainer.callbacks if isinstance(c, MemorySnapshots)), None)


def start_afresh(trainer: "RunView") -> str:
    """What to remove to start afresh here (the advice of a refused resume)."""
    snapshots = snapshots_of(trainer)
    disk = trainer.checkpointer.start_afresh() if trainer.checkpointer.latest() else ""
    if snapshots is None:
        return disk or trainer.checkpointer.start_afresh()
    return (f"{disk} and " if disk else "") + (
        f"run `sailfin clean {trainer.args.output_dir}` (its memory snapshots in "
        f"{snapshots.store.root})")


def stepped_state(trainer: "RunView") -> frozenset:
    """The storages only an optimizer step changes: the parameters and optimizers' state."""
    tensors = [*trainer.module.parameters(),
               *(v for opt in trainer.optimizers for s in opt.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor))]
    locals_ = (t.to_local() if hasattr(t, "to_local") else t for t in tensors)
    return frozenset((t.untyped_storage().data_ptr(), str(t.device)) for t in locals_)


def state_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` (shared storages counted once; ``meta`` tensors by
    their size; a DTensor by its local shard)."""
    return sum(storage_sizes(obj).values())


def storage_sizes(obj: Any) -> dict[Any, int]:
    """Each distinct storage of the tensors in ``obj``, and its bytes."""
    seen: dict[Any, int] = {}

    def count(value: torch.Tensor) -> None:
        value = value.to_local() if hasattr(value, "to_local") else value
        if value.device.type == "meta":
            seen[id(value)] = value.numel() * value.element_size()
        else:
            storage = value.untyped_storage()
            seen[(storage.data_ptr(), str(value.device))] = storage.nbytes()

    map_tree(obj, count, is_tensor)
    return seen


def stepped_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes ``optimizer``'s state holds once it has stepped: a twin of it steps once on
    ``meta`` copies of this rank's parameters; 0 when it cannot (a full file system then
    stops the snapshots with one warning)."""
    inner = _inner(optimizer)
    if inner.state:
        return state_bytes(dict(inner.state))
    groups = []
    for group in inner.param_groups:
        metas = []
        for param in group["params"]:
            local = param.to_local() if hasattr(param, "to_local") else param
            meta = torch.nn.Parameter(torch.empty_like(local, device="meta"),
                                      requires_grad=param.requires_grad)
            if param.requires_grad:
                meta.grad = torch.empty_like(meta)
            metas.append(meta)
        # No fused or capturable kernels for meta tensors: the state they keep is the same.
        plain = {k: False for k in ("fused", "capturable", "foreach") if k in group}
        groups.append({**group, **plain, "params": metas})
    twin = object.__new__(type(inner))
    try:
        torch.optim.Optimizer.__init__(twin, groups, dict(inner.defaults))
        with torch.no_grad():
            twin.step()
    except Exception:  # an optimizer that needs more than torch's contract
        return 0
    return state_bytes(dict(twin.state))


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "original_optimizer", optimizer)  # Opacus wraps the recipe's


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
