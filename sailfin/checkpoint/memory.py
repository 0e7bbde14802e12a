"""Memory snapshots: the run's state as checkpoint files in shared memory, every N steps.

A snapshot is an ordinary checkpoint (``model.pt``, ``trainer.pt``,
``rng-rank<r>.pt`` and the same ``manifest.json`` with sizes and CRC-32s) in a
directory on a RAM file system (:mod:`.memory_dirs`). Files there outlive the
worker, so a restarted worker reads them back instead of a disk checkpoint.

Replicated state is written once per node: under ``ddp`` (every rank holds the
same model and optimizer) the node's local leader writes ``model.pt`` and
``trainer.pt``, and every other rank of the node only its own random state,
its manifest naming the leader (``shared_from``); a restart reads the node's
copy. Under ``fsdp`` each rank writes its own shard.

The step pays only the copy of the state into reused staging buffers, files
mapped shared in the node's directory; a writer process (:mod:`.memory_writer`)
serialises and checksums from there, writes the files under ``.tmp-step-N`` and
renames the directory when complete; a thread waits for it and (``replicas: 1``) sends the files to a rank on the next
node, which keeps them under ``replica-rank<r>/``. At the next snapshot every
rank says whether its previous one is complete (one tiny all-reduce): if one
is still being written, every rank skips this step rather than wait; if one
found the file system full, every rank stops taking snapshots (one warning;
training and disk checkpoints go on); else the older ones are removed. Every
rank therefore always holds a step that all ranks hold complete, and at most
two snapshots (that one and the one being written).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

from . import manifest as manifests
from .errors import CheckpointCorrupt, CheckpointError
from .memory_dirs import free_bytes, used_bytes
from . import memory_transfer
from .memory_files import intact, read_manifest, step_name
from .memory_peers import Peers
from .memory_writer import SharedStaging, WriterProcess
from .serialize import load_object
from .storage import LocalStorage

__all__ = ["MemoryStore", "NoSpace", "rank_file", "step_name"]

_STEP = re.compile(r"^step-(\d+)$")
# The previous snapshot, as the ranks agree on it (MIN): a failure wins over a full file
# system, which wins over one still being written.
_FAILED, _FULL, _BUSY, _READY = 0, 1, 2, 3
_OWN = re.compile(r"^rank(\d+)$")
_REPLICA = re.compile(r"^replica-rank(\d+)$")


class NoSpace(OSError):
    """The snapshot directory's file system cannot hold the next snapshot."""


def rank_file(rank: int) -> str:
    return f"rng-rank{rank:05d}.pt"


def _is_full(error: Optional[BaseException]) -> bool:
    """Whether ``error`` (or what caused it: a write error wraps the OSError) is a full
    file system."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        error = error.__cause__
    return False


class MemoryStore:
    """This rank's snapshots (and the replica it keeps) in ``root``, one node's directory.

    Example::

        store = MemoryStore("/dev/shm/sailfin-run-node0", rank=0, world_size=1)
        store.save(12, facts, {"model": model.state_dict(), "trainer": rest}, rng)
        store.wait()
        manifest, shared, rng = store.load(store.inventory()[0][12])
    """

    def __init__(self, root: str, rank: int, world_size: int, local_world_size: int = 1,
                 replicas: int = 0, peers: Optional[Peers] = None,
                 local_rank: Optional[int] = None) -> None:
        self.root = root
        self.rank, self.world_size = rank, world_size
        self.local_rank = rank % local_world_size if local_rank is None else local_rank
        self.leader = rank - self.local_rank  # writes the node's copy of replicated state
        self.peers = peers or Peers(rank, world_size)
        self.storage = LocalStorage()
        # The step copies the state into files mapped shared; a process writes from them.
        self._staging = SharedStaging(os.path.join(root, f"staging-rank{rank:05d}"))
        self._writer = WriterProcess()
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[tuple[int, Future]] = None
        self._last: Optional[int] = None  # the step of the last snapshot started
        self._bytes: dict[int, int] = {}  # step -> bytes this rank wrote to the node for it
        self.run = ""  # the run's identity (memory_dirs.run_identity), in every manifest
        self.skipped = 0  # snapshots skipped: the previous one was still being written
        self.stopped: Optional[str] = None  # why snapshots stopped (the file system filled)
        self._full: Optional[BaseException] = None  # a write found it full (seen by wait)
        # Replicas go to the same local rank on the next node, and come from the previous.
        self.replica_dst = self.replica_src = None
        if replicas and world_size > local_world_size:
            self.replica_dst = (rank + local_world_size) % world_size
            self.replica_src = (rank - local_world_size) % world_size

    # -- places ------------------------------------------------------------------------
    def own_dir(self, rank: Optional[int] = None) -> str:
        return os.path.join(self.root, f"rank{self.rank if rank is None else rank:05d}")

    def replica_dir(self, rank: int) -> str:
        return os.path.join(self.root, f"replica-rank{rank:05d}")

    # -- writing -----------------------------------------------------------------------
    def start_writer(self, wait: bool = False) -> None:
        """Start the writer process (``wait``: until it can write; before the first step,
        so that the first snapshot is not late)."""
        if wait:
            self._writer.ready()
        else:
            self._writer.start()

    def save(self, step: int, facts: dict[str, Any], shared: dict[str, Any],
             rank_state: Any, replicated: bool = False) -> bool:
        """Snapshot ``step`` on every rank; False when skipped (or stopped). Every rank says
        whether its previous snapshot is written (one tiny all-reduce): if one is still
        being written, every rank skips this step (the step never waits for a write); if
        one found the file system full, every rank stops; once all are written, older
        snapshots go, the state is copied into the staging buffers, and the files are
        written in the background. ``replicated``: ``shared`` is the same on every rank,
        and only the node's leader writes it."""
        if self.stopped is not None:
            return False
        busy = self._pending is not None and not self._pending[1].done()
        error = (self._pending[1].exception() if self._pending is not None and not busy
                 else self._full)
        agreed = self.peers.min(_FULL if _is_full(error) else _FAILED if error else
                                _BUSY if busy else _READY)
        if agreed == _BUSY:
            self.skipped += 1
            return False
        self._finish()
        if agreed == _FULL:
            self._stop(step, error)
            return False
        if agreed == _FAILED:
            raise CheckpointError(
                f"the memory snapshot of step {self._last} failed"
                + (f" on rank {self.rank}: {error}" if error else " on another rank")
                + f" ({self.root}); free shared memory, set trainer.checkpoint.memory.dir, "
                "or turn snapshots off (trainer.checkpoint.memory.every_n_steps: null)")
        if self._last is not None:
            self.prune(keep_from=self._last)  # every rank has it complete
        if replicated and self.rank != self.leader:
            shared = {}  # the node's leader writes it
        try:
            staged = self._staging.copy({"shared": shared, "rank": rank_state})
        except OSError as exc:
            if not _is_full(exc):
                raise
            self._full = exc  # the next snapshot's agreement stops them on every rank
            return False
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="sailfin-memory")
        self._last = step
        self._pending = (step, self._executor.submit(
            self._write, step, dict(facts), staged["shared"], staged["rank"], replicated))
        return True

    def _stop(self, step: int, error: Optional[BaseException]) -> None:
        """The file system is full: no more snapshots. The complete ones stay (a restart
        may resume from the newest one every rank holds); unfinished ones go."""
        self.prune(keep_from=0)
        self._writer.close()
        self._staging.release()
        self.stopped = (f"memory snapshots stopped at step {step}: {self.root} is full"
                        + (f" ({error})" if error else " on another rank")
                        + "; training and disk checkpoints go on. Give snapshots more room "
                        "(a larger /dev/shm or trainer.checkpoint.memory.dir)")

    def _finish(self) -> Optional[BaseException]:
        if self._pending is None:
            return None
        _, future = self._pending
        self._pending = None
        try:
            future.result()
        except Exception as exc:  # reported through every rank's agreement
            return exc
        return None

    def wait(self) -> None:
        """Block until the last snapshot is written (and replicated); raise if it failed
        for another reason than a full file system."""
        step = self._last
        error = self._finish()
        if _is_full(error):
            self._full = error  # the next snapshot's agreement stops them on every rank
        elif error is not None:
            raise CheckpointError(f"the memory snapshot of step {step} in {self.root} "
                                  f"failed: {error}") from error

    def _write(self, step: int, facts: dict[str, Any], shared: dict[str, Any],
               rank_state: Any, replicated: bool) -> None:
        """The writer thread: the writer process writes the files (this thread waits on
        its pipe), then the replica goes to the next node."""
        facts = {**facts, "memory_snapshot": {
            "rank": self.rank, "run": self.run, "replicated": replicated,
            "shared_from": None if shared else self.leader}}
        files = {**shared, rank_file(self.rank)[:-3]: rank_state}
        os.makedirs(self.own_dir(), exist_ok=True)
        self._writer.write(self.own_dir(), step_name(step), files, facts,
                           self._staging.directory)
        final = os.path.join(self.own_dir(), step_name(step))
        if self.replica_dst is not None:
            self._replicate(step, final)
        self._check_room(step, used_bytes(final) * (2 if self.replica_dst is not None else 1))

    def _check_room(self, step: int, size: int) -> None:
        """The next snapshot replaces the one before this: it must fit in what is free
        now plus what that one frees (the state grew, or the file system filled)."""
        previous = self._bytes.get(max((s for s in self._bytes if s < step), default=-1), 0)
        self._bytes = {step: size}
        free = free_bytes(self.root)
        if free + previous < size:
            raise NoSpace(errno.ENOSPC, f"the next snapshot needs {size / 2**20:.1f} MiB, "
                          f"{(free + previous) / 2**20:.1f} MiB would be free")

    def _replicate(self, step: int, final: str) -> None:
        assert self.replica_dst is not None and self.replica_src is not None
        memory_transfer.exchange(self.peers.background, final, self.replica_dst,
                                 self.replica_src, self.replica_dir(self.replica_src), step)

    # -- what is there -----------------------------------------------------------------
    def inventory(self) -> dict[int, dict[int, str]]:
        """Rank -> step -> directory of every complete, intact snapshot in this node's
        directory (own or replica) that a rank of this run can resume from. Left out: a
        snapshot without a manifest, or whose files do not have its sizes (a half-written
        one; CRC-32s are checked by :meth:`load`, of the one snapshot loaded), or taken by
        another run, or sharded on another world size (a
        resized fsdp job resumes from disk), or whose node copy of the replicated state
        is not here intact."""
        found: dict[int, dict[int, tuple[str, Optional[int]]]] = {}
        for entry in sorted(self.storage.listdir(self.root)):  # own copies before replicas
            match = _OWN.match(entry) or _REPLICA.match(entry)
            if not match or int(match.group(1)) >= self.world_size:
                continue
            rank = int(match.group(1))
            for name in self.storage.listdir(os.path.join(self.root, entry)):
                step = _STEP.match(name)
                path = os.path.join(self.root, entry, name)
                if not step or int(step.group(1)) in found.get(rank, {}):
                    continue
                manifest = intact(path, self.world_size, self.run, verify=False)
                if manifest is not None:
                    source = (manifest.get("memory_snapshot") or {}).get("shared_from")
                    found.setdefault(rank, {})[int(step.group(1))] = (path, source)
        return {rank: {step: path for step, (path, source) in steps.items()
                       if source is None or found.get(source, {}).get(step, ("", 0))[1] is None}
                for rank, steps in found.items()}

    def load(self, path: str) -> tuple[dict[str, Any], dict[str, Any], Any]:
        """(manifest, shared state, this rank's random state) of the snapshot in ``path``;
        the shared state from the node's copy when another rank wrote it."""
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
        own = rank_file(self.rank)
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

    # -- removing ----------------------------------------------------------------------
    def prune(self, keep_from: int = 0, only: Optional[int] = None) -> None:
        """Remove this rank's snapshots (and the replica it keeps) older than ``keep_from``
        (with ``only``: every step but that one) and unfinished ones. Never called while
        a snapshot is being written."""
        dirs = [self.own_dir()] + ([self.replica_dir(self.replica_src)]
                                   if self.replica_src is not None else [])
        for directory in dirs:
            for name in self.storage.listdir(directory):
                match = _STEP.match(name)
                step = int(match.group(1)) if match else None
                if step is None or (step != only if only is not None else step < keep_from):
                    shutil.rmtree(os.path.join(directory, name), ignore_errors=True)

    def remove_mine(self) -> None:
        """Remove this rank's snapshots and the replica it keeps (a normal end)."""
        self.wait()
        shutil.rmtree(self.own_dir(), ignore_errors=True)
        if self.replica_src is not None:
            shutil.rmtree(self.replica_dir(self.replica_src), ignore_errors=True)
        with_owner = os.path.join(self.root, f"owner-rank{self.rank:05d}.json")
        if os.path.exists(with_owner):
            os.remove(with_owner)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            self._writer.close()
            self._staging.release()
