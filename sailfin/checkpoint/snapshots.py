"""Memory snapshots: two buffer sets per rank in the node's shared memory *are* the snapshot.

Each rank keeps two sets, ``a`` and ``b`` (:mod:`.snapshot_sets`), in its directory
(:mod:`.snapshot_dirs`). A snapshot is copied once, into the set that does not hold the
newest step every rank holds, and a header naming its step is committed by rename. The
parameters and optimizer state are copied while the next forward and backward run (a
thread's ``copy_`` on the CPU; on a GPU a copy on a side stream into host memory
registered as pinned), and the next optimizer step waits for that copy. The other set's
header always names an intact step: a kill loses at most one.

Example::

    store = SnapshotStore("/dev/shm/sailfin-run-node0", rank=0, world_size=1)
    store.take(12, facts, {"model": model.state_dict(), "trainer": rest}, rng)
    store.settle()                       # before the next optimizer step
    store.wait()
    header, shared, rng = store.load(store.inventory()[0][12])
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from concurrent.futures import Future, wait
from typing import Any, Callable, Optional

import torch

from ..utils.crc import crc32
from ..utils.voice import say
from .errors import CheckpointCorrupt, CheckpointError, no_space
from .snapshot_dirs import Peers, exchange, names, remove_file
from .snapshot_layout import Layout, Planner, dump_state
from .snapshot_sets import (SETS, Buffer, Copy, Location, Worker, header_bytes,
                            read_bin, read_header, read_set, sample_crc)

_RANK_DIR = re.compile(r"^(?:replica-)?rank(\d+)$")
# The last snapshot, as the ranks agree on it (MIN): a failure wins over a full file system.
_FAILED, _FULL, _READY = 0, 1, 2


class SnapshotStore:
    """This rank's snapshots (and the replica it keeps) in ``root``, one node's directory."""

    def __init__(self, root: str, rank: int, world_size: int, local_world_size: int = 1,
                 replicas: int = 0, local_rank: Optional[int] = None) -> None:
        self.root, self.rank, self.world_size = root, rank, world_size
        self.local_rank = rank % local_world_size if local_rank is None else local_rank
        self.leader = rank - self.local_rank  # the node's first rank
        self.local_world_size = local_world_size  # replicated state: each copies a share
        self.node = rank // local_world_size
        self.peers = Peers(world_size)
        self.run = ""  # snapshot_dirs.run_identity, in every header
        self.stopped = False  # the file system filled
        self.agreed: Optional[int] = None  # the newest step every rank holds
        self.newest: Optional[int] = None  # this rank's newest committed step
        self.committed = threading.Event()  # the last snapshot is committed (or dropped)
        self.committed.set()
        self.busy = False  # the last settle waited for the copy (slower than the steps)
        self._steps: dict[Location, int] = {}  # what each set of ours holds
        self._buffers: dict[str, Buffer] = {}
        self._streams: dict = {}
        self._worker = Worker("sailfin-snapshot")
        self._planner = Planner()  # the state's layout, kept while it does not change
        self._pending: Optional[tuple] = None  # taken, its copy not settled
        self._finishing: Optional[Future] = None  # commit, replica, agreement
        self._error: Optional[BaseException] = None
        self.replica_dst = self.replica_src = None  # the same local rank on the next node
        if replicas and world_size > local_world_size:
            self.replica_dst = (rank + local_world_size) % world_size
            self.replica_src = (rank - local_world_size) % world_size

    def own_dir(self, rank: Optional[int] = None) -> str:
        return os.path.join(self.root, f"rank{self.rank if rank is None else rank:05d}")

    def replica_dir(self, rank: int) -> str:
        return os.path.join(self.root, f"replica-rank{rank:05d}")

    def _dirs(self) -> list[str]:
        src = self.replica_src
        return [self.own_dir()] + ([self.replica_dir(src)] if src is not None else [])

    def _free(self, directory: str) -> Location:
        """The set of ``directory`` that may be written: not the one every rank needs."""
        return next(loc for loc in (Location(directory, n) for n in SETS)
                    if self._steps.get(loc) is None or self._steps[loc] != self.agreed)

    def take(self, step: int, facts: dict[str, Any], shared: dict[str, Any], rank_state: Any,
             replicated: bool = False, later: Optional[Callable[[], frozenset]] = None,
             finite: Optional[torch.Tensor] = None) -> bool:
        """Copy the state of ``step`` into the free set: what is not in ``later()`` (storage
        keys ``(data_ptr, device)``; None: nothing) now, the rest beside training until
        :meth:`settle`. ``replicated``: ``shared`` is the same on every rank: the node keeps
        one copy, each of its ranks copying a share of the storages (the node's ranks
        take the same steps). ``finite``: a flag read by the snapshot thread; false: the
        set is not committed (the step's weights are spoiled). False when snapshots have
        stopped (a full file system)."""
        if self.stopped or not self._agree(step):
            return False
        parts = ([self.leader + i for i in range(self.local_world_size)] if replicated
                 else [self.rank])
        where = self._free(self.own_dir())
        remove_file(where.path("json"))  # being rewritten: never resumed meanwhile
        self._steps.pop(where, None)
        skeleton, layout = self._planner.plan(shared, rank_state, later or frozenset,
                                              later is not None, parts.index(self.rank),
                                              len(parts))
        buffer = self._buffers.setdefault(where.path("bin"), Buffer(where.path("bin")))
        try:
            if not os.path.isdir(where.directory):
                os.makedirs(where.directory, exist_ok=True)
            buffer.hold(layout.total, layout.cuda)
        except OSError as exc:
            if not no_space(exc):
                raise
            self._pending = (step, where, None, None, None, layout, None, exc, None)
            self.settle()  # the agreement stops snapshots on every rank
            return False
        pairs = buffer.pairs(layout)
        for destination, source in pairs[:layout.now]:
            destination.copy_(source)
        blob = dump_state({"layout": layout.table, "state": skeleton})
        facts = {**facts, "memory_snapshot": {
            "rank": self.rank, "run": self.run, "replicated": replicated, "parts": parts,
            "part": layout.part, "layout": layout.ident}}
        copy = (Copy(self._worker, pairs[layout.now:],
                     [t for _, t in layout.sources[layout.now:]], self._streams, layout.cuda)
                if layout.now < len(pairs) else None)
        # A copy on the CPU: its thread then writes the set and stages its header beside
        # training; the optimizer step's wait only renames it (after checking the sources).
        prepared = (self._worker.submit(self._write, where, facts, blob, layout)
                    if copy is not None and not copy.events else None)
        self._pending = (step, where, facts, blob, copy, layout, finite, None, prepared)
        if copy is None:
            self.settle()
        return True

    @property
    def copying(self) -> bool:
        return self._pending is not None

    def settle(self) -> Optional[bool]:
        """Before the optimizer step: wait for the copy :meth:`take` left running, then
        commit the set. None when there was none; False when a source changed meanwhile
        (the snapshot is dropped: not the state of one step)."""
        if self._pending is None:
            return None
        step, where, facts, blob, copy, layout, finite, error, prepared = self._pending
        self._pending = None
        unchanged, self.busy = error is None, False
        if copy is not None:
            try:
                unchanged = copy.before_step()
                self.busy = copy.busy or (prepared is not None and not prepared.done())
            except Exception as exc:  # noqa: BLE001 - every rank raises at the agreement
                error, unchanged = exc, False
        self.committed.clear()
        job = (step, where, facts, blob, copy, layout, error, unchanged, finite)
        if (copy is not None and copy.events) or (finite is not None and finite.is_cuda):
            # A GPU's copy or loss flag: waited for on the snapshot thread, not here.
            self._finishing = self._worker.submit(self._finish, *job)
            return unchanged
        # The copy is done: commit here (a rename), not on the snapshot thread, whose Python
        # would hold the interpreter lock while the optimizer step wants it.
        status = self._commit(*job, prepared)
        if self.peers.group is None and self.replica_dst is None:
            self._finishing = Future()
            self._finishing.set_result(self._share(status, where, step))
        else:  # collectives: on the snapshot thread's group
            self._finishing = self._worker.submit(self._share, status, where, step)
        return unchanged

    def _finish(self, step: int, where: Location, *job: Any) -> tuple[int, int]:
        """The snapshot thread: commit the set, then :meth:`_share`."""
        return self._share(self._commit(step, where, *job), where, step)

    def _commit(self, step: int, where: Location, facts: Any, blob: Any, copy: Optional[Copy],
                layout: Layout, error: Optional[BaseException], commit: bool,
                finite: Optional[torch.Tensor] = None, prepared: Optional[Future] = None) -> int:
        """Commit the set's header (written by :meth:`_write`, here or ``prepared`` on the
        snapshot thread), unless the snapshot is dropped (a source changed, a non-finite
        loss spoiled the weights); the status to agree on."""
        status = _READY
        try:
            if error is not None:
                raise error
            if commit and (finite is None or bool(finite)):
                if copy is not None:
                    copy.done()  # a GPU's copy: its events
                staged = (prepared.result() if prepared is not None
                          else self._write(where, facts, blob, layout))
                os.replace(staged, where.path("json"))  # the commit
                self._steps[where] = self.newest = step
                return status
        except Exception as exc:  # noqa: BLE001 - said at the agreement, on every rank
            status, self._error = (_FULL if no_space(exc) else _FAILED), exc
        finally:
            self.committed.set()
        if prepared is not None:
            wait([prepared])
        remove_file(where.path("next"))  # dropped or failed: no staged header stays
        return status

    def _write(self, where: Location, facts: dict[str, Any], blob: bytes,
               layout: Layout) -> str:
        """Write the set's small state and its header, staged beside the header's name
        (the sizes and CRC-32s of what the set holds now); the staged header's path."""
        with open(where.path("pt"), "wb") as fh:
            fh.write(blob)
        total, full = layout.total, layout.full
        data = self._buffers[where.path("bin")].data[:total]
        facts["memory_snapshot"].update(state=[len(blob), crc32(blob)],
                                        tensors=[total, full, sample_crc(data, full)])
        with open(where.path("next"), "wb") as fh:
            fh.write(header_bytes(facts))
        return where.path("next")

    def _share(self, status: int, where: Location, step: int) -> tuple[int, int]:
        """Send the replica, then agree with every rank on the newest step all of them
        hold (a failure anywhere wins)."""
        if self.replica_dst is not None:
            try:
                mine = where if self._steps.get(where) == step else None
                into = self._free(self.replica_dir(self.replica_src))  # type: ignore[arg-type]
                got = exchange(self.peers.background, mine, self.replica_dst, self.replica_src,
                               into)
                if got is not None:
                    self._steps[into] = got
            except BaseException as exc:  # noqa: BLE001
                status, self._error = _FAILED, exc
        return self.peers.min_pair(status, -1 if self.newest is None else self.newest)

    def _agree(self, step: int) -> bool:
        """Wait for the last snapshot's agreement: raise if it failed on a rank, stop the
        snapshots if one found the file system full."""
        self.settle()
        future, self._finishing = self._finishing, None
        if future is None:
            return True
        status, agreed = future.result()
        self.agreed = agreed if agreed >= 0 else None
        if status == _FULL:
            self._stop(step)
            return False
        if status == _FAILED:
            error, self._error = self._error, None
            raise CheckpointError(
                f"the memory snapshot before step {step} failed"
                + (f" on rank {self.rank}: {error}" if error else " on another rank")
                + f" ({self.root}); free shared memory, set trainer.checkpoint.memory.dir, "
                "or turn snapshots off (trainer.checkpoint.memory.every_n_steps: null)")
        return True

    def _stop(self, step: int) -> None:
        # The file system is full: no more snapshots; the step every rank holds stays.
        self.keep_only(self.agreed)
        for buffer in self._buffers.values():
            buffer.release()
        self.stopped = True
        if self.rank == 0:
            error = self._error
            say(f"memory snapshots stopped at step {step}: {self.root} is full"
                + (f" ({error})" if error else " on another rank")
                + "; training and disk checkpoints go on. Give snapshots more room "
                "(a larger /dev/shm or trainer.checkpoint.memory.dir)")

    def wait(self) -> None:
        """Until the last snapshot is committed, replicated and agreed on; raise if it
        failed on a rank."""
        self.settle()
        if self._finishing is not None:
            self._finishing.result()  # (the next take reads its agreement)

    def keep_only(self, step: Optional[int]) -> None:
        """Remove every set (own and replica) but those holding ``step`` (None: all), and
        anything else in those directories; the next snapshot goes to the other set."""
        for directory in self._dirs():
            keep = set()
            for name in SETS:
                where = Location(directory, name)
                try:
                    held = read_header(where)["step"]
                except CheckpointCorrupt:
                    held = None
                if held is not None and held == step:
                    keep |= {f"{name}.json", f"{name}.pt", f"{name}.bin"}
                    self._steps[where] = step
                else:
                    self._steps.pop(where, None)
                    self._buffers.pop(where.path("bin"), Buffer("")).release()
            for entry in names(directory):
                if entry not in keep:
                    path = os.path.join(directory, entry)
                    shutil.rmtree(path) if os.path.isdir(path) else remove_file(path)
        self.agreed = step

    def inventory(self) -> dict[int, dict[int, Location]]:
        """Rank -> step -> set of the snapshots a rank of this run can resume from: headers
        intact, files of their size, every part of replicated state present."""
        found: dict[int, dict[int, tuple[Location, list]]] = {}
        for entry in sorted(names(self.root)):  # own copies ("rank...") before replicas
            match = _RANK_DIR.match(entry)
            if not match or int(match.group(1)) >= self.world_size:
                continue
            rank = int(match.group(1))
            for name in SETS:
                where = Location(os.path.join(self.root, entry), name)
                header = self._usable(where)
                if header is not None and header["step"] not in found.get(rank, {}):
                    found.setdefault(rank, {})[header["step"]] = (where, header)
        return {rank: {step: where for step, (where, header) in steps.items()
                       if self._parts_present(header)}
                for rank, steps in found.items()}

    def _parts_present(self, header: dict[str, Any]) -> bool:
        about = header["memory_snapshot"]
        try:
            for part, rank in enumerate(about["parts"]):
                if part != about["part"]:
                    self._part(rank, header)
            return True
        except CheckpointCorrupt:
            return False

    def _usable(self, where: Location) -> Optional[dict[str, Any]]:
        try:
            header = read_header(where)
            about = header["memory_snapshot"]
            if about["run"] != self.run or (header["world_size"] != self.world_size
                                            and not about["replicated"]):
                return None
            sizes = (os.path.getsize(where.path("pt")), os.path.getsize(where.path("bin")))
            if (sizes[0] != about["state"][0] or sizes[1] < about["tensors"][0]
                    or about["parts"][about["part"]] != about["rank"]):
                return None
            return header
        except (OSError, KeyError, TypeError, IndexError, CheckpointCorrupt):
            return None

    def load(self, where: Location) -> tuple[dict[str, Any], dict[str, Any], Any]:
        """(header, shared state, this rank's random state) of the set ``where``, every
        check of the header done (see docs/memory-snapshots.md)."""
        header = read_header(where)
        about = header["memory_snapshot"]

        def other_part(part: int) -> torch.Tensor:
            found = self._part(about["parts"][part], header)
            return read_bin(found, read_header(found))

        state = read_set(where, header, other_part)
        return header, state["shared"], state["rank"]

    def _part(self, rank: int, header: dict[str, Any]) -> Location:
        """The set of ``rank`` (on this node: its own or a replica) that holds the part of
        ``header``'s snapshot that rank copied: the same step and layout."""
        step, layout = header["step"], header["memory_snapshot"]["layout"]
        for directory in (self.own_dir(rank), self.replica_dir(rank)):
            for name in SETS:
                where = Location(directory, name)
                other = self._usable(where)
                if (other is not None and other["step"] == step
                        and other["memory_snapshot"]["layout"] == layout):
                    return where
        raise CheckpointCorrupt(f"memory snapshot of step {step}: the part rank {rank} "
                                f"copied (of the state every rank of the node holds) is "
                                f"missing in {self.root}", self.root)

    def remove_mine(self) -> None:
        self.wait()
        for directory in self._dirs():
            shutil.rmtree(directory, ignore_errors=True)
        remove_file(os.path.join(self.root, f"owner-rank{self.rank:05d}.json"))

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._worker.stop()
            for buffer in self._buffers.values():
                buffer.release()
