"""Checkpointers: the abstract interface and the default, one directory per save (its
layout and commit: docs/checkpoints-and-resume.md)."""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..config.checkpoint import CheckpointArguments
from ..distributed import DistEnv
from . import manifest as manifests
from .dcp_io import (RNG, SHARDS, DcpWriter, ShardedRef, locate_shards, read_small, rng_key,
                     small_entries)
from .errors import CheckpointCorrupt, CheckpointError
from .layout import _STEP, DirectoryLayout
from .serialize import FileEntry, load_object, read_checked
from .storage import Storage, open_storage


@dataclass
class SaveRequest:
    """One save as the trainer hands it to a checkpointer, on every rank. Rank 0 writes
    ``shared`` (entry name -> object, the same on every rank); ``rank_state`` is this rank's
    own (its random streams); ``facts`` are plain JSON values for the manifest. All of it
    goes into one DCP save (:mod:`.dcp_io`)."""

    step: int
    facts: dict[str, Any]
    shared: dict[str, Any]
    rank_state: Any
    is_best: bool = False
    sharded: dict[str, Any] = field(default_factory=dict)
    """The model and optimizers (and any DTensor state), written with DCP by every rank."""
    later: frozenset = frozenset()
    """Storages in ``sharded`` an async save may copy until :meth:`Checkpointer.settle`."""


@dataclass
class Loaded:
    """A checkpoint read back: what :class:`SaveRequest` held, for this rank."""

    name: str
    location: str
    manifest: dict[str, Any]
    shared: dict[str, Any]
    rank_state: Optional[Any] = None
    """None when the checkpoint has no state for this rank (it ran on fewer ranks)."""
    sharded: Optional[ShardedRef] = None
    """The checkpoint's DCP shards (None: the model is ``shared["model"]``)."""


class Checkpointer(abc.ABC):
    """Saves and loads checkpoints. Subclass it to keep them elsewhere or in another form.

    Every rank calls :meth:`save` with its :class:`SaveRequest` and :meth:`load` to read
    back; ``barrier()`` waits for every rank. ``trainer.checkpoint.class_path`` names a
    subclass, built as ``cls(location, args, dist, barrier)``.

    Example::

        class AnnouncingCheckpointer(DirectoryCheckpointer):
            def commit(self, name, staging, files, request):
                super().commit(name, staging, files, request)
                print("saved", name)
    """

    def __init__(self, location: str, args: CheckpointArguments, dist: DistEnv,
                 barrier: Callable[[], None] = lambda: None) -> None:
        self.location = location
        self.args = args
        self.dist = dist
        self.barrier = barrier

    @abc.abstractmethod
    def save(self, request: SaveRequest) -> None:
        """Save on every rank; may return before the data is on storage (async saves)."""

    @abc.abstractmethod
    def latest(self) -> Optional[str]:
        """The newest complete checkpoint's name, or None."""

    @abc.abstractmethod
    def load(self, name: str) -> Loaded:
        """Read a checkpoint (a name from :meth:`latest`, or a path). Raises
        :class:`CheckpointCorrupt` naming the file when it is damaged."""

    def candidates(self) -> list[str]:
        """Complete checkpoints, newest first: what ``resume: auto`` tries in turn."""
        latest = self.latest()
        return [latest] if latest else []

    def wait(self) -> None:
        """Block until every save started so far is on storage; raise if one failed."""

    def close(self) -> None:
        self.wait()

    def recover(self) -> None:
        """Called on every rank before resuming: put back what a killed save left."""

    def start_afresh(self) -> str:
        """What to remove to start afresh here (the advice of a refused resume)."""
        return f"remove {self.location}"

    def settle(self) -> bool:
        """Before each optimizer step while async saves are on: wait for what the last save
        copies in the background (:attr:`SaveRequest.later`); True when there was such a copy."""
        return False

    def abort(self) -> None:
        """Called after a save failed (on every rank that saw it fail): remove its
        partial files, keep every complete checkpoint."""


class DirectoryCheckpointer(DirectoryLayout, Checkpointer):
    """The default: one directory per save, atomic commit, keep-last and best (the names
    and the tidying are :class:`.layout.DirectoryLayout`'s).

    Example::

        ckpt = DirectoryCheckpointer("outputs/checkpoints", CheckpointArguments(keep_last=2),
                                     DistEnv())
        name = ckpt.latest()            # "step-00000120" or None
        state = ckpt.load(name).shared["trainer"]
    """

    def __init__(self, location: str, args: CheckpointArguments, dist: DistEnv,
                 barrier: Callable[[], None] = lambda: None) -> None:
        super().__init__(location, args, dist, barrier)
        self.storage, self.root = open_storage(location, args.storage_options)
        local = self.storage.local_path(self.root)
        if local is not None and os.path.exists(local) and not os.path.isdir(local):
            raise CheckpointError(
                f"checkpoint directory {local} is a file, not a directory; move it away, or "
                "set trainer.checkpoint.dir (or trainer.output_dir) to another place")
        self.shards = DcpWriter(self.storage, args.storage_options, self.shard_writer)
        self.writes_shards = True  # SaveRequest.sharded is written, with DCP
        self._saving = -1  # the step of the save in flight (async)

    def save(self, request: SaveRequest) -> None:
        self.wait()  # one save in flight at a time; raises if the previous one failed
        name = self.name_for(request.step)
        staging = self.path(f".tmp-{name}" if self.storage.atomic_rename else name)
        self.storage.makedirs(staging)
        if self.dist.is_main and not self.storage.atomic_rename:
            # Re-saving a step in place (a run resumed before it): it is incomplete from now on.
            self.storage.remove(self.storage.join(staging, manifests.MANIFEST))
        # The small state as bytes made now: under async_save they are the save's copy.
        state = {**request.sharded,
                 **small_entries(request.shared, request.rank_state, self.dist.rank)}
        self._saving = request.step
        # Rank 0 commits once every rank's part is on storage (async: in the writer thread).
        then = (lambda: self._commit(name, staging, request)) if self.dist.is_main else None
        self.shards.save(staging, state, self.args.async_save, request.step, request.later,
                         then)

    def _commit(self, name: str, staging: str, request: SaveRequest) -> None:
        request.facts["sharded"] = self.shards.described()  # the manifest lists them
        self.commit(name, staging, {}, request)
        self.retain()

    def shard_writer(self, path: str) -> Any:
        """The DCP storage writer of the shards at ``path`` (every rank). Override to
        throttle, compress or observe writes."""
        return self.shards.writer(path)

    def commit(self, name: str, staging: str, files: dict[str, FileEntry],
               request: SaveRequest) -> None:
        """Make the written files a complete checkpoint, then move ``latest`` (and ``best``).
        ``files``: files beside the shards to list in the manifest (sailfin writes none)."""
        for leftover in set(self.storage.listdir(staging)) - set(files) - {SHARDS}:
            self.storage.remove(self.storage.join(staging, leftover))  # from a killed save
        facts = {**request.facts, "is_best": request.is_best}
        self.storage.write_bytes(self.storage.join(staging, manifests.MANIFEST),
                                 manifests.encode(facts, files))
        if self.storage.atomic_rename:
            self.move_into_place(staging, name)
        self.storage.write_bytes(self.path("latest"), f"{name}\n".encode())
        if request.is_best:
            self.storage.write_bytes(self.path("best"), f"{name}\n".encode())

    def settle(self) -> bool:
        return self.shards.settle()

    def wait(self) -> None:
        try:
            self.shards.wait()
        except CheckpointError:  # the shards' write failure, said already
            raise
        except Exception as exc:  # rank 0's commit, in the writer thread
            raise CheckpointError(f"the background save of step {self._saving} to "
                                  f"{self.storage.display(self.root)} failed: {exc}") from exc

    def close(self) -> None:
        self.shards.close()

    def load(self, name: str, mmap: bool = False) -> Loaded:
        """``mmap``: memory-map local files (tensors are read when touched)."""
        storage, where = self._locate(name)
        shown = storage.display(where)
        manifest_path = storage.join(where, manifests.MANIFEST)
        try:
            raw = read_checked(storage, manifest_path, storage.display(manifest_path),
                               what="checkpoint manifest", limit=manifests.MAX_BYTES,
                               within=where)
        except FileNotFoundError:
            raise CheckpointCorrupt(f"checkpoint {shown} has no {manifests.MANIFEST}: the save "
                                    "did not finish", storage.display(manifest_path)) from None
        manifest = manifests.decode(raw, storage.display(manifest_path))
        sharded = locate_shards(storage, where, manifest, self.args.storage_options,
                                self.dist.rank, self.dist.world_size)
        own = rng_key(self.dist.rank)
        if manifest["format"] == manifests.FORMAT:  # the small state is in the shards
            if sharded is None:
                raise CheckpointCorrupt(f"checkpoint manifest in {shown} lists no shards and "
                                        "no files: it is damaged", shown)
            read = read_small(sharded, [key for key in sharded.entries
                                        if not key.startswith(RNG) or key == own])
            rank_state = read.pop(own, None)
            return Loaded(name, shown, manifest, read, rank_state, sharded)
        # Saved by an earlier release: trainer.pt, rng-rank0000N.pt (and model.pt) beside it.
        files = manifests.files_of(manifest, storage.display(manifest_path))
        shared = {file[:-len(".pt")]: load_object(storage, storage.join(where, file), entry,
                                                  mmap, within=where)
                  for file, entry in files.items() if not file.startswith("rng-rank")}
        own = f"rng-rank{self.dist.rank:05d}.pt"
        rank_state = (load_object(storage, storage.join(where, own), files[own], within=where)
                      if own in files else None)
        return Loaded(name, shown, manifest, shared, rank_state, sharded)

    def _locate(self, name: str) -> tuple[Storage, str]:
        """A checkpoint name in this directory, or a path/URL to a checkpoint or a directory
        of them (then its newest)."""
        if _STEP.match(name) and self.storage.exists(self.path(name)):
            return self.storage, self.path(name)
        storage, where = open_storage(name, self.args.storage_options)
        manifest, base = storage.join(where, manifests.MANIFEST), os.path.basename(where)
        local = storage.local_path(manifest)
        if (storage.exists(manifest) or (local is not None and os.path.lexists(local))
                or (_STEP.match(base) and storage.exists(where))):
            return storage, where  # a checkpoint, perhaps damaged: loading it says how
        if not storage.exists(where):
            raise CheckpointError(f"trainer.resume: {name!r} does not exist; give a checkpoint "
                                  "directory (one holding manifest.json), a directory of "
                                  "checkpoints, auto or never")
        inner = DirectoryCheckpointer(name, self.args, self.dist)
        newest = inner.latest()
        if newest is None:
            raise CheckpointError(f"trainer.resume: {storage.display(where)} holds no complete "
                                  "checkpoint (no manifest.json in it or in any step-* "
                                  "directory under it)")
        return storage, storage.join(where, newest)
