"""Memory snapshots: the run's state as checkpoint files in shared memory, every N steps.

A snapshot is an ordinary checkpoint in a directory on a RAM file system
(:mod:`.memory_dirs`) that outlives the worker: a restarted worker reads it back
instead of a disk checkpoint. Training pays only a copy into staging buffers
(:mod:`.memory_staging`); a writer process (:mod:`.memory_writer`) writes the
files, and the ranks agree before each snapshot that the previous one is
complete everywhere, so every rank always holds a step that all ranks hold
(docs/memory-snapshots.md).
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil
from concurrent.futures import Future, ThreadPoolExecutor, wait as wait_for
from typing import Any, Optional

from ..utils.voice import say
from . import manifest as manifests
from .errors import CheckpointCorrupt, CheckpointError
from .layout import DirectoryLayout
from .memory_dirs import (free_bytes, held, prune_snapshots, read_manifest, recycle,
                          step_name, used_bytes)
from .memory_staging import PendingCopy, SharedStaging, remove_file
from .memory_transfer import Peers, exchange
from .memory_writer import Verdict, WriterProcess
from .serialize import load_object
from .storage import LocalStorage

# The previous snapshot, as the ranks agree on it (MIN): a failure wins over a full file
# system.
_FAILED, _FULL, _READY = 0, 1, 2


def _is_full(error: Optional[BaseException]) -> bool:
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)


class MemoryStore:
    """This rank's snapshots (and the replica it keeps) in ``root``, one node's directory.

    Example::

        store = MemoryStore("/dev/shm/sailfin-run-node0", rank=0, world_size=1)
        store.save(12, facts, {"model": model.state_dict(), "trainer": rest}, rng)
        store.wait()
        manifest, shared, rng = store.load(store.inventory()[0][12])
    """

    def __init__(self, root: str, rank: int, world_size: int, local_world_size: int = 1,
                 replicas: int = 0, local_rank: Optional[int] = None) -> None:
        self.root = root
        self.rank, self.world_size = rank, world_size
        self.local_rank = rank % local_world_size if local_rank is None else local_rank
        self.leader = rank - self.local_rank  # writes the node's copy of replicated state
        self.node = rank // local_world_size
        self.peers = Peers(world_size)
        self.storage = LocalStorage()
        self._staging = SharedStaging(os.path.join(root, f"staging-rank{rank:05d}"))
        self._writer = WriterProcess()
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Future] = None  # the last snapshot's write
        self._copying: Optional[tuple[PendingCopy, Verdict]] = None  # copied while training
        self._prune_from: Optional[int] = None  # older snapshots go before the next write
        self._complete: Optional[int] = None  # the step of the newest snapshot renamed
        self._last: Optional[int] = None  # the step of the last snapshot started
        self._bytes = 0  # what this rank wrote to the node for its newest snapshot
        self.run = ""  # memory_dirs.run_identity, in every manifest
        self.stopped = False  # the file system filled
        self._full: Optional[BaseException] = None  # a write found it full (seen by wait)
        # Replicas go to the same local rank on the next node, and come from the previous.
        self.replica_dst = self.replica_src = None
        if replicas and world_size > local_world_size:
            self.replica_dst = (rank + local_world_size) % world_size
            self.replica_src = (rank - local_world_size) % world_size

    def own_dir(self, rank: Optional[int] = None) -> str:
        return os.path.join(self.root, f"rank{self.rank if rank is None else rank:05d}")

    def replica_dir(self, rank: int) -> str:
        return os.path.join(self.root, f"replica-rank{rank:05d}")

    def start_writer(self, wait: bool = False) -> None:
        """Start the writer process (``wait``: until it can write)."""
        if wait:
            self._writer.ready()
        else:
            self._writer.start()

    def save(self, step: int, facts: dict[str, Any], shared: dict[str, Any],
             rank_state: Any, replicated: bool = False) -> bool:
        """:meth:`ready`, then :meth:`stage` copying everything at once."""
        return self.ready(step) and self.stage(step, facts, shared, rank_state, replicated)

    def written(self) -> bool:
        """Wait until the last snapshot's files are written (and replicated); True when it
        had to wait. Whether it succeeded is left to :meth:`ready`."""
        self.settle()
        if self._pending is None or self._pending.done():
            return False
        wait_for([self._pending])
        return True

    def ready(self, step: int) -> bool:
        """Whether every rank takes the snapshot of ``step``, once each has written its
        previous one: if one failed, every rank raises; if one found the file system full,
        every rank stops; else older snapshots go."""
        if self.stopped:
            return False
        self.settle()
        error = self._finish() or self._full  # (waits for the write)
        agreed = self.peers.min(_FULL if _is_full(error) else _FAILED if error else _READY)
        if agreed == _FULL:
            self._stop(step, error)
            return False
        if agreed == _FAILED:
            raise CheckpointError(
                f"the memory snapshot of step {self._last} failed"
                + (f" on rank {self.rank}: {error}" if error else " on another rank")
                + f" ({self.root}); free shared memory, set trainer.checkpoint.memory.dir, "
                "or turn snapshots off (trainer.checkpoint.memory.every_n_steps: null)")
        # Every rank has the last one complete: older ones go, in the writer's thread
        # before it writes the next (removing a snapshot's files frees its pages: ms).
        self._prune_from = self._complete
        return True

    def stage(self, step: int, facts: dict[str, Any], shared: dict[str, Any],
              rank_state: Any, replicated: bool = False, later: frozenset = frozenset()
              ) -> bool:
        """After :meth:`ready`: copy the state into the staging buffers and have the files
        written in the background; False when the file system is full. The storages in
        ``later`` are copied while training goes on (see :meth:`settle`). ``replicated``:
        ``shared`` is the same on every rank, and only the node's leader writes it."""
        if replicated and self.rank != self.leader:
            shared = {}  # the node's leader writes it
        try:
            staged, copying = self._staging.stage({"shared": shared, "rank": rank_state},
                                                  later)
        except OSError as exc:
            if not _is_full(exc):
                raise
            self._full = exc  # the next snapshot's agreement stops them on every rank
            return False
        # The state's other values may change before the write: the staged copy's
        # containers are its own and its scalars immutable, so only a value of another
        # type (a set, an array) makes it worth freezing whole, pickled now.
        frozen = pickle.dumps(staged) if self._staging.kept else staged
        verdict: Optional[Verdict] = None
        if copying is not None:
            verdict = Verdict()  # settle() says whether the copy holds this step's state
            self._copying = (copying, verdict)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="sailfin-memory")
        self._last = step
        keep_from, self._prune_from = self._prune_from, None
        self._pending = self._executor.submit(self._write, keep_from, step, dict(facts),
                                              frozen, replicated, copying, verdict)
        return True

    @property
    def copying(self) -> bool:
        return self._copying is not None

    def settle(self) -> Optional[bool]:
        """Wait for the copy :meth:`stage` left to a thread: None when there was none;
        False when a source changed meanwhile (the snapshot is dropped: it would not be
        the state of one step)."""
        if self._copying is None:
            return None
        copying, verdict = self._copying
        self._copying = None
        try:
            unchanged = copying.finish()
        except BaseException:
            verdict.give(False)  # the copy failed: never renamed
            raise
        verdict.give(unchanged)
        if unchanged and verdict.written.is_set():
            # The files are written: the rename is a moment, and the step it waits for
            # then ends with its snapshot complete.
            verdict.renamed.wait()
        return unchanged

    def _stop(self, step: int, error: Optional[BaseException]) -> None:
        # The file system is full: no more snapshots; the complete ones stay.
        self.prune(keep_from=0)
        self._writer.close()
        self._staging.release()
        self.stopped = True
        if self.rank == 0:
            say(f"memory snapshots stopped at step {step}: {self.root} is full"
                + (f" ({error})" if error else " on another rank")
                + "; training and disk checkpoints go on. Give snapshots more room "
                "(a larger /dev/shm or trainer.checkpoint.memory.dir)")

    def _finish(self) -> Optional[BaseException]:
        future, self._pending = self._pending, None
        return None if future is None else future.exception()

    def wait(self) -> None:
        """Block until the last snapshot is written (and replicated); raise if it failed
        for another reason than a full file system."""
        self.settle()
        error = self._finish()
        if _is_full(error):
            self._full = error  # the next snapshot's agreement stops them on every rank
        elif error is not None:
            raise CheckpointError(f"the memory snapshot of step {self._last} in {self.root} "
                                  f"failed: {error}") from error

    def _write(self, keep_from: Optional[int], step: int, facts: dict[str, Any],
               frozen: Any, replicated: bool, copying: Optional[PendingCopy],
               verdict: Optional[Verdict]) -> None:
        """The writer thread: older snapshots go, the files are written once ``copying`` is
        done and renamed if ``verdict`` says so, then the replica goes to the next node."""
        if keep_from is not None:  # the oldest one's directory becomes the new one's
            self.prune(keep_from, spare=recycle(self.own_dir(), keep_from, step))
        staged = pickle.loads(frozen) if isinstance(frozen, bytes) else frozen
        shared, rank_state = staged["shared"], staged["rank"]
        facts = {**facts, "memory_snapshot": {
            "rank": self.rank, "run": self.run, "replicated": replicated,
            "shared_from": None if shared else self.leader}}
        files = {**shared, DirectoryLayout.rank_file(self.rank)[:-3]: rank_state}
        if copying is not None:
            try:
                copying.wait()
            except Exception:
                return  # the training thread raises it (settle)
        try:
            renamed = self._writer.write(self.own_dir(), step_name(step), files, facts,
                                         self._staging.directory,
                                         verdict.wait if verdict is not None else None)
        finally:
            if verdict is not None:
                verdict.renamed.set()
        final = os.path.join(self.own_dir(), step_name(step)) if renamed else None
        if self.replica_dst is not None:  # (a dropped one too: the peer expects a header)
            exchange(self.peers.background, final, self.replica_dst, self.replica_src,
                     self.replica_dir(self.replica_src), step)  # type: ignore[arg-type]
        if final is not None:
            self._complete = step
            # The next snapshot, replacing the one before this, must fit in what is free
            # plus what that one frees (the state grew, or the file system filled).
            size = used_bytes(final) * (2 if self.replica_dst is not None else 1)
            free = free_bytes(self.root) + self._bytes
            self._bytes = size
            if free < size:
                raise OSError(errno.ENOSPC, f"the next snapshot needs {size / 2**20:.1f} MiB, "
                              f"{free / 2**20:.1f} MiB would be free")

    def inventory(self) -> dict[int, dict[int, str]]:
        """Rank -> step -> directory of the snapshots a rank can resume from."""
        return held(self.root, self.world_size, self.run)

    def load(self, path: str) -> tuple[dict[str, Any], dict[str, Any], Any]:
        """(manifest, shared state, this rank's random state) of the snapshot in ``path``."""
        manifest_path = os.path.join(path, manifests.MANIFEST)
        try:
            manifest = read_manifest(path)
        except FileNotFoundError:
            raise CheckpointCorrupt(f"memory snapshot {path} has no manifest",
                                    manifest_path) from None
        files = manifests.files_of(manifest, manifest_path)
        source = (manifest.get("memory_snapshot") or {}).get("shared_from")
        where, shared_files = path, files
        if source is not None:
            where = self._copy_of(source, os.path.basename(path))
            shared_files = manifests.files_of(read_manifest(where), where)
        shared = {f[:-3]: load_object(self.storage, os.path.join(where, f), e)
                  for f, e in shared_files.items() if not f.startswith("rng-rank")}
        own = DirectoryLayout.rank_file(self.rank)
        if own not in files:
            raise CheckpointCorrupt(f"memory snapshot {path} holds no random state for rank "
                                    f"{self.rank}", path)
        return manifest, shared, load_object(self.storage, os.path.join(path, own), files[own])

    def _copy_of(self, rank: int, step: str) -> str:
        for directory in (self.own_dir(rank), self.replica_dir(rank)):
            if os.path.isdir(os.path.join(directory, step)):
                return os.path.join(directory, step)
        raise CheckpointCorrupt(f"memory snapshot {step} of rank {rank} (the node's copy of "
                                f"the model and optimizer) is missing in {self.root}",
                                self.root)

    def prune(self, keep_from: int = 0, only: Optional[int] = None,
              spare: Optional[str] = None) -> None:
        """:func:`prune_snapshots` in this rank's directory and the replica it keeps; never
        called while a snapshot is being written."""
        prune_snapshots(self.own_dir(), keep_from, only, spare)
        if self.replica_src is not None:
            prune_snapshots(self.replica_dir(self.replica_src), keep_from, only, spare)

    def remove_mine(self) -> None:
        self.wait()
        shutil.rmtree(self.own_dir(), ignore_errors=True)
        if self.replica_src is not None:
            shutil.rmtree(self.replica_dir(self.replica_src), ignore_errors=True)
        remove_file(os.path.join(self.root, f"owner-rank{self.rank:05d}.json"))

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            self._writer.close()
            self._staging.release()
