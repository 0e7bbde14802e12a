"""Memory snapshots: each rank's state as checkpoint files in shared memory, every N steps.

A snapshot is an ordinary checkpoint of one rank (``model.pt``, ``trainer.pt``,
``rng-rank<r>.pt`` and the same ``manifest.json`` with sizes and CRC-32s) in a
directory on a RAM file system (:mod:`.memory_dirs`). Files there outlive the
worker, so a restarted worker reads them back instead of a disk checkpoint.

The step pays only the copy of the state into reused staging buffers; a
writer thread writes the files under ``.tmp-step-N``, renames the directory
when complete, and (``replicas: 1``) sends the files to a rank on the next
node, which keeps them under ``replica-rank<r>/``. At the next snapshot every
rank says whether its previous one is complete (one tiny all-reduce): if one
is still being written, every rank skips this step rather than wait; else the
older ones are removed. Every rank therefore always holds a step that all ranks
hold complete, and at most two snapshots (that one and the one being written).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

from . import manifest as manifests
from .errors import CheckpointCorrupt, CheckpointError
from .memory_peers import Peers
from .serialize import FileEntry, StagingBuffers, _checksum_file, load_object, save_object
from .storage import LocalStorage

_STEP = re.compile(r"^step-(\d+)$")
_FAILED, _BUSY, _READY = 0, 1, 2  # the previous snapshot, as the ranks agree on it (MIN)
_OWN = re.compile(r"^rank(\d+)$")
_REPLICA = re.compile(r"^replica-rank(\d+)$")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_file(rank: int) -> str:
    return f"rng-rank{rank:05d}.pt"


class MemoryStore:
    """This rank's snapshots (and the replica it keeps) in ``root``, one node's directory.

    Example::

        store = MemoryStore("/dev/shm/sailfin-run-node0", rank=0, world_size=1)
        store.save(12, facts, {"model": model.state_dict(), "trainer": rest}, rng)
        store.wait()
        manifest, shared, rng = store.load(store.inventory()[0][12])
    """

    def __init__(self, root: str, rank: int, world_size: int, local_world_size: int = 1,
                 replicas: int = 0, peers: Optional[Peers] = None) -> None:
        self.root = root
        self.rank, self.world_size = rank, world_size
        self.peers = peers or Peers(rank, world_size)
        self.storage = LocalStorage()
        self._staging = StagingBuffers()
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[tuple[int, Future]] = None
        self._last: Optional[int] = None  # the step of the last snapshot started
        self.run = ""  # the run's identity (memory_dirs.run_identity), in every manifest
        self.skipped = 0  # snapshots skipped: the previous one was still being written
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
    def save(self, step: int, facts: dict[str, Any], shared: dict[str, Any],
             rank_state: Any) -> bool:
        """Snapshot ``step`` on every rank; False when skipped. Every rank says whether its
        previous snapshot is written (one tiny all-reduce): if one is still being written,
        every rank skips this step (the step never waits for a write); once all are, older
        snapshots go, the state is copied into the staging buffers, and the files are
        written in the background."""
        busy = self._pending is not None and not self._pending[1].done()
        failed = (self._pending is not None and not busy
                  and self._pending[1].exception() is not None)
        agreed = self.peers.min(_FAILED if failed else _BUSY if busy else _READY)
        if agreed == _BUSY:
            self.skipped += 1
            return False
        error = self._finish()
        if agreed == _FAILED:
            raise CheckpointError(
                f"the memory snapshot of step {self._last} failed"
                + (f" on rank {self.rank}: {error}" if error else " on another rank")
                + f" ({self.root}); free shared memory, set trainer.checkpoint.memory.dir, "
                "or turn snapshots off (trainer.checkpoint.memory.every_n_steps: null)")
        if self._last is not None:
            self.prune(keep_from=self._last)  # every rank has it complete
        staged = self._staging.copy({"shared": shared, "rank": rank_state})
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="sailfin-memory")
        self._last = step
        self._pending = (step, self._executor.submit(
            self._write, step, dict(facts), staged["shared"], staged["rank"]))
        return True

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
        """Block until the last snapshot is written (and replicated); raise if it failed."""
        step = self._last
        error = self._finish()
        if error is not None:
            raise CheckpointError(f"the memory snapshot of step {step} in {self.root} "
                                  f"failed: {error}") from error

    def _write(self, step: int, facts: dict[str, Any], shared: dict[str, Any],
               rank_state: Any) -> None:
        self._staging.ready()
        directory = self.own_dir()
        staging = os.path.join(directory, f".tmp-{step_name(step)}")
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        files: dict[str, FileEntry] = {}
        for stem, obj in shared.items():
            files[f"{stem}.pt"] = save_object(self.storage, os.path.join(staging, f"{stem}.pt"),
                                              obj)
        own = rank_file(self.rank)
        files[own] = save_object(self.storage, os.path.join(staging, own), rank_state)
        facts = {**facts, "memory_snapshot": {"rank": self.rank, "run": self.run}}
        with open(os.path.join(staging, manifests.MANIFEST), "wb") as fh:
            fh.write(manifests.encode(facts, files))
        final = os.path.join(directory, step_name(step))
        shutil.rmtree(final, ignore_errors=True)  # a snapshot of this step from before a restart
        os.rename(staging, final)
        if self.replica_dst is not None:
            self._replicate(step, final)

    def _replicate(self, step: int, final: str) -> None:
        assert self.replica_dst is not None and self.replica_src is not None
        received = self.peers.exchange(pack(final), self.replica_dst, self.replica_src)
        unpack(received, self.replica_dir(self.replica_src), step)

    # -- what is there -----------------------------------------------------------------
    def inventory(self) -> dict[int, dict[int, str]]:
        """Rank -> step -> directory of every complete, intact snapshot in this node's
        directory (own or replica). A snapshot without a manifest, or whose files do
        not match it (a half-written or damaged one), or taken on another world size
        (a resized job resumes from disk), or by another run, is left out."""
        found: dict[int, dict[int, str]] = {}
        for entry in self.storage.listdir(self.root):
            match = _OWN.match(entry) or _REPLICA.match(entry)
            if not match or int(match.group(1)) >= self.world_size:
                continue
            rank = int(match.group(1))
            for name in self.storage.listdir(os.path.join(self.root, entry)):
                step = _STEP.match(name)
                path = os.path.join(self.root, entry, name)
                if (step and int(step.group(1)) not in found.get(rank, {})
                        and intact(path, self.world_size, self.run)):
                    found.setdefault(rank, {})[int(step.group(1))] = path
        return found

    def load(self, path: str) -> tuple[dict[str, Any], dict[str, Any], Any]:
        """(manifest, shared state, this rank's random state) of the snapshot in ``path``."""
        manifest_path = os.path.join(path, manifests.MANIFEST)
        try:
            with open(manifest_path, "rb") as fh:
                manifest = manifests.decode(fh.read(), manifest_path)
        except FileNotFoundError:
            raise CheckpointCorrupt(f"memory snapshot {path} has no manifest",
                                    manifest_path) from None
        files = manifests.files_of(manifest, manifest_path)
        shared = {f[:-3]: load_object(self.storage, os.path.join(path, f), e)
                  for f, e in files.items() if not f.startswith("rng-rank")}
        own = rank_file(self.rank)
        if own not in files:
            raise CheckpointCorrupt(f"memory snapshot {path} holds no random state for rank "
                                    f"{self.rank}", path)
        return manifest, shared, load_object(self.storage, os.path.join(path, own), files[own])

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
            self._staging.release()


def intact(path: str, world_size: Optional[int] = None, run: Optional[str] = None) -> bool:
    """Whether the snapshot in ``path`` has a manifest and every file matches it (and it
    was taken on ``world_size`` ranks, by the run ``run``)."""
    manifest_path = os.path.join(path, manifests.MANIFEST)
    try:
        with open(manifest_path, "rb") as fh:
            manifest = manifests.decode(fh.read(), manifest_path)
        files = manifests.files_of(manifest, manifest_path)
        if world_size is not None and manifest.get("world_size") != world_size:
            return False
        if run is not None and (manifest.get("memory_snapshot") or {}).get("run") != run:
            return False
        return all(_checksum_file(os.path.join(path, name)) == (entry.size, entry.crc32)
                   for name, entry in files.items())
    except (OSError, CheckpointCorrupt):
        return False


def pack(path: str) -> bytes:
    """A snapshot directory's files as one byte string (a JSON header, then the bytes)."""
    names = sorted(os.listdir(path))
    blobs = []
    for name in names:
        with open(os.path.join(path, name), "rb") as fh:
            blobs.append(fh.read())
    header = json.dumps({n: len(b) for n, b in zip(names, blobs)}).encode("utf-8")
    return len(header).to_bytes(8, "little") + header + b"".join(blobs)


def unpack(data: bytes, directory: str, step: int) -> str:
    """Write what :func:`pack` made as ``directory/step-N``, complete or not at all."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size].decode("utf-8"))
    staging = os.path.join(directory, f".tmp-{step_name(step)}")
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    view, offset = memoryview(data), 8 + size
    # The manifest last, as in every save: without it the copy is incomplete.
    for name in sorted(header, key=lambda n: n == manifests.MANIFEST):
        start = offset + _before(header, name)
        with open(os.path.join(staging, name), "wb") as fh:
            fh.write(view[start:start + header[name]])
    final = os.path.join(directory, step_name(step))
    shutil.rmtree(final, ignore_errors=True)
    os.rename(staging, final)
    return final


def _before(header: dict[str, int], name: str) -> int:
    """Where ``name``'s bytes start in the packed data (after the header)."""
    total = 0
    for other in header:  # the order pack wrote them in
        if other == name:
            return total
        total += header[other]
    raise KeyError(name)
