"""``trainer.checkpoint.memory``: snapshot the trainer's state to shared memory every N steps.

The storage is :mod:`sailfin.checkpoint.memory`; this callback decides when, hands it
the state, checks before the first step that snapshots fit, persists every
``persist_every_n_steps`` as an ordinary checkpoint, and removes the snapshots when the
run ends normally.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from ...checkpoint import CheckpointError, Checkpointer, memory_dirs
from ...checkpoint.memory_checkpointer import MemoryFirstCheckpointer, local_shards
from ...checkpoint.memory_staging import remove_file
from ...checkpoint.rng import rng_state
from ...checkpoint.staging import optimizer_storages, storage_key
from ...config.trainer import TrainerArguments
from ...utils.voice import say
from ..core.callbacks import Callback, notify_save_end
from .saver import CheckpointCallback, manifest_facts

if TYPE_CHECKING:
    from ..core.view import RunView

StepHook = Callable[[int, Any, Any], None]  # (global_step, loss, stats): on_end_train_step
_FILE_OVERHEAD = 1 << 16  # torch.save's archive around the tensors, per file (generous)


class MemorySnapshots(Callback):
    """Snapshots every ``every_n_steps`` optimizer steps; training waits for the copy, and
    for a write only when it is slower than the steps between snapshots.
    ``stall_seconds`` records how long each snapshot held training; ``write_waits`` the
    waits for a write.

    Example::

        args = TrainerArguments(checkpoint={"memory": {"every_n_steps": 1}})
        Trainer(module, args).train()   # the trainer adds this callback itself
    """

    def __init__(self, checkpointer: MemoryFirstCheckpointer, args: TrainerArguments,
                 saver: Optional[CheckpointCallback]) -> None:
        self.checkpointer, self.store = checkpointer, checkpointer.store
        memory = args.checkpoint.memory
        self.every = memory.every_n_steps if isinstance(memory.every_n_steps, int) else 1
        self.persist = memory.persist_every_n_steps
        # Persisting is an ordinary (async) save; the saver also supplies the best metric.
        self.saver = saver or CheckpointCallback(checkpointer, args.checkpoint)
        self.stall_seconds: list[float] = []
        self.write_waits: list[float] = []  # a step waited for the previous write (seconds)
        self.snapshot_bytes = 0  # one rank's whole snapshot state, as counted before step 1
        self.overlap = True  # copy the stepped state during the next forward and backward
        self._config: Optional[dict] = None  # trainer.args, shared by every snapshot

    def on_train_start(self, trainer: "RunView") -> None:
        # What a run before this one left (newer steps above all) must never be resumed.
        self.store.prune(only=trainer.global_step)
        self.check_space(trainer)
        self.store.start_writer(wait=True)

    def on_step_end(self, trainer: "RunView") -> None:
        step = trainer.global_step
        if step % self.every == 0:
            self.snapshot(trainer)
        if self.persist and step % self.persist == 0:
            self.saver.save(trainer)  # skipped when a step save of the same step just ran

    def snapshot(self, trainer: "RunView") -> None:
        started = time.perf_counter()
        trainer.nonfinite.check()  # never snapshot weights a non-finite loss spoiled
        if self.store.ready(trainer.global_step):
            trainer.writers.flush()  # metrics.jsonl holds every event up to the snapshot
            state = trainer.state_dict()
            if self._config is None:  # as the manifests hold it; the run's does not change
                self._config = dataclasses.asdict(trainer.args)
            facts = manifest_facts(trainer, self.saver, state, self._config)
            # fsdp: this rank's rows, as plain tensors (no model mesh: nothing is sharded)
            local = local_shards(state) if self.checkpointer.mesh is not None else state
            replicated = local is state  # no shards: every rank holds the same (ddp)
            shared = {"model": local.pop("module"), "trainer": local}
            later = stepped_state(trainer) if self.overlap else frozenset()
            self.store.stage(trainer.global_step, facts, shared, rng_state(), replicated,
                             later)
        self.stall_seconds.append(time.perf_counter() - started)
        if not self.store.copying:  # else said when the copy is settled, with its wait
            notify_save_end(trainer, "snapshot", self.stall_seconds[-1])  # the time account

    def on_backward_end(self, trainer: "RunView", samples: int) -> bool:
        # Before the optimizer step changes them: the last snapshot's copy is done.
        self.settle(trainer)
        return False

    def before_log(self, trainer: "RunView", then: Optional[StepHook]) -> Optional[StepHook]:
        """The trainer's ``on_end_train_step`` (``then`` the recipe's): a step that takes a
        snapshot first waits until the previous one is written. Once a step is logged, the
        snapshot before it is complete: a kill loses at most ``every_n_steps`` steps."""
        every = self.every

        def step_done(global_step: int, loss: Any, stats: Any) -> None:
            if global_step % every == 0:
                self.settle(trainer, written=True)
            if then is not None:
                then(global_step, loss, stats)

        return step_done

    def settle(self, trainer: "RunView", written: bool = False) -> None:
        started = time.perf_counter()
        settled = self.store.settle()
        waited = written and self.store.written()
        if settled is None and not waited:
            return
        seconds = time.perf_counter() - started
        self.stall_seconds[-1] += seconds
        if waited:
            self.write_waits.append(seconds)
        # The time account: the whole stall once its copy is settled, else this wait.
        notify_save_end(trainer, "snapshot", self.stall_seconds[-1] if settled is not None
                        else seconds)
        if settled is False and self.overlap:
            self.overlap = False
            say(f"memory snapshots: rank {trainer.dist.rank}'s parameters or optimizer "
                f"state changed between step {trainer.global_step}'s end and the next "
                "optimizer step (a forward that changes its weights in place, such as "
                "nn.Embedding(max_norm=...), or a callback): that snapshot is dropped, and "
                "from now on each snapshot is copied before training goes on", warning=True)

    def on_train_end(self, trainer: "RunView") -> None:
        self.settle(trainer)
        if self.write_waits and trainer.dist.is_main:
            say(f"memory snapshots: {len(self.write_waits)} of {len(self.stall_seconds)} "
                f"waited {sum(self.write_waits):.1f} s in all for the previous one's write "
                "(slower than the steps between snapshots); a larger "
                "trainer.checkpoint.memory.every_n_steps leaves the writer more time")
        # The final state is on disk (the saver's on_train_end ran first): the RAM goes back.
        self.store.remove_mine()
        trainer.backend.barrier()
        if self.store.local_rank == 0:
            shutil.rmtree(self.store.root, ignore_errors=True)
            remove_file(os.path.join(trainer.args.output_dir,
                                     f"{memory_dirs.RECORD}{self.store.node}"))

    def check_space(self, trainer: "RunView") -> None:
        """Two snapshots per writing rank (plus two replicas) and its staging copy, the
        optimizer's state counted as after the first step, must fit each node's free
        shared memory; else stop before the first step, on every rank."""
        state = trainer.state_dict()
        local = local_shards(state)
        # The whole snapshot state: the optimizers' state as after their first step.
        grown = sum(max(0, stepped_state_bytes(opt) - state_bytes(dict(_inner(opt).state)))
                    for opt in trainer.optimizers)
        shared = state_bytes(local) + grown + 2 * _FILE_OVERHEAD
        own = state_bytes(rng_state()) + _FILE_OVERHEAD
        self.snapshot_bytes = shared + own
        replicas = self.store.replica_dst is not None
        writes_shared = local is not state or self.store.rank == self.store.leader
        writes = (shared if writes_shared else 0) + own  # ddp: the node's leader only
        root = self.store.root
        free = memory_dirs.free_bytes(root) + memory_dirs.used_bytes(root)
        reports = self.store.peers.all_gather((self.store.node, writes, free, root))
        for where in sorted({r[0] for r in reports}):
            on_node = [r for r in reports if r[0] == where]
            need = sum(r[1] * (2 * (1 + replicas) + 1) for r in on_node)
            free, root = on_node[0][2], on_node[0][3]
            if need <= free:
                continue
            raise CheckpointError(
                f"trainer.checkpoint.memory: snapshots need {_mb(need)} on node {where} "
                f"(2 snapshots"
                + (" and 2 replicas" if replicas else "")
                + f" and a staging copy of {_mb(max(r[1] for r in on_node))} at most per "
                f"rank, model and optimizer state once per node, {len(on_node)} rank(s)"
                + f") but {root} has {_mb(free)} free; enlarge /dev/shm (docker run "
                "--shm-size), point trainer.checkpoint.memory.dir at a larger tmpfs"
                + (", set trainer.checkpoint.memory.replicas: 0" if replicas else "")
                + ", or turn snapshots off (trainer.checkpoint.memory.every_n_steps: null)")


def stepped_state(trainer: "RunView") -> frozenset:
    """The storages only an optimizer step changes: the parameters and optimizers' state."""
    return (frozenset(storage_key(p) for p in trainer.module.parameters())
            | optimizer_storages(trainer.optimizers))


def memory_snapshot_callback(checkpointer: Checkpointer, args: TrainerArguments,
                             saver: Optional[CheckpointCallback],
                             module: torch.nn.Module) -> list[MemorySnapshots]:
    """The callback ``trainer.checkpoint.memory`` asks for (none when it is off); built
    before resume, which rebuilds fsdp shards on the model's device mesh."""
    if not isinstance(checkpointer, MemoryFirstCheckpointer):
        return []
    checkpointer.mesh = next((p.device_mesh for p in module.parameters()  # fsdp's DTensors
                              if hasattr(p, "device_mesh")), None)
    if args.checkpoint.memory.every_n_steps == "auto":  # chosen from measurements
        from .auto_interval import AutoMemorySnapshots
        return [AutoMemorySnapshots(checkpointer, args, saver)]
    return [MemorySnapshots(checkpointer, args, saver)]


def state_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` (shared storages counted once; ``meta`` tensors by
    their size; a DTensor by its local shard)."""
    seen: dict[Any, int] = {}
    stack = [obj]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if hasattr(value, "to_local"):  # a DTensor (fsdp): this rank's rows
                value = value.to_local()
            if value.device.type == "meta":
                seen[id(value)] = value.numel() * value.element_size()
            else:
                storage = value.untyped_storage()
                seen[(storage.data_ptr(), str(value.device))] = storage.nbytes()
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return sum(seen.values())


def stepped_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes ``optimizer``'s state holds once it has stepped: a twin of it steps once on
    ``meta`` copies of this rank's parameters; 0 when it cannot (the writer checks the
    room again after each snapshot)."""
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
    except Exception:  # an optimizer that needs more than torch's contract: measured later
        return 0
    return state_bytes(dict(twin.state))


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "original_optimizer", optimizer)  # Opacus wraps the recipe's


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
