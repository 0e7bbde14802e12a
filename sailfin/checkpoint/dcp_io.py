"""The one DCP save and load of a checkpoint: model, optimizers and sailfin's small state.

Every rank writes ``<checkpoint>/shards`` with ``torch.distributed.checkpoint`` (DCP): the
model and optimizers under the names PyTorch's distributed state dicts give them (DCP
re-cuts them on load for any world size and backend), and sailfin's small state as bytes
entries: ``trainer`` (counters, schedulers, scaler, ``get_state()``, callbacks; rank 0's)
and each rank's random streams, ``rng/rank0000N``. One commit covers everything: the
manifest, written last, lists the files and small entries with their CRC-32s. Bytes are
read back only with ``torch.load(weights_only=True)``. torch alone opens it::

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save("step-00000120/shards", "step-120.pt")
    # {"module": ..., "optimizers": ..., "trainer": {...}, "rng/rank00000": {...}}
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pickle
import re
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from ..compat.torch import dcp_load, fsspec_reader, fsspec_writer, streams_flushable_after_close
from .errors import CheckpointCorrupt, CheckpointError, per_rank, reason, write_failure
from .serialize import FileEntry, plain_name
from .shard_checksums import (check_index, checksummed_writer, describe, restricted_reader,
                              verify)
from .staging import SplitStager
from .storage import LocalStorage, Storage

# DCP warns at every call made in one process (sp, or no process group), which is meant.
# Process-wide for the async saves' writer thread; a context around the training
# thread's calls, where pytest resets the filters.
_SINGLE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"
warnings.filterwarnings("ignore", message=_SINGLE_PROCESS, category=UserWarning)


@contextlib.contextmanager
def _one_process_is_meant() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS, category=UserWarning)
        yield

FORMAT = "torch-dcp/1"
SHARDS = "shards"
CALLBACKS = "callbacks"
DCP_KEYS = ("module", "optimizers")  # always in DCP, whatever the backend
RNG = "rng/"  # the random streams' entries: one per rank


def rng_key(rank: int) -> str:
    """The entry of ``rank``'s random streams."""
    return f"{RNG}rank{rank:05d}"


def small_entries(shared: dict[str, Any], rank_state: Any, rank: int) -> dict[str, io.BytesIO]:
    """sailfin's small state as DCP bytes entries: ``shared`` (name -> object, the same on
    every rank) from rank 0 alone, so exactly one copy lands; this rank's own state under
    :func:`rng_key`. Made now: under ``async_save`` these bytes are the save's copy."""
    entries = {**(shared if rank == 0 else {}),
               **({rng_key(rank): rank_state} if rank_state is not None else {})}
    out = {key: io.BytesIO() for key in entries}
    for key, value in entries.items():
        torch.save(value, out[key])
    return out


def split_sharded(state: dict[str, Any], dcp_callbacks: Iterable[str] = ()) -> dict[str, Any]:
    """Move out of ``state`` and return, for DCP: the model and optimizers, the callbacks
    named in ``dcp_callbacks`` and any other entry that holds DTensors."""
    from torch.distributed.tensor import DTensor

    sharded = {key: state[key] for key, value in state.items()
               if key in DCP_KEYS or (key != CALLBACKS and holds(value, DTensor))}
    for key in sharded:
        del state[key]
    # Such a callback's state goes to "callbacks/<name>": DCP stages it with the model.
    callbacks = state.pop(CALLBACKS, None)
    if callbacks is not None:
        chosen = frozenset(dcp_callbacks)
        to_dcp = {k for k, v in callbacks.items() if k in chosen or holds(v, DTensor)}
        state[CALLBACKS] = {k: v for k, v in callbacks.items() if k not in to_dcp}
        sharded.update({f"{CALLBACKS}/{k}": callbacks[k] for k in sorted(to_dcp)})
    # DCP flattens nested dicts; lists become dicts keyed "0", "1", ... (see load_sharded).
    return {k: ({str(i): v for i, v in enumerate(value)} if isinstance(value, list) else value)
            for k, value in sharded.items()}


def holds(value: Any, kind: type) -> bool:
    """Whether ``value`` (dicts, lists and tuples) holds an instance of ``kind``."""
    inner = (value.values() if isinstance(value, dict) else
             value if isinstance(value, (list, tuple)) else ())
    return isinstance(value, kind) or any(holds(item, kind) for item in inner)


def _save_planner() -> Any:
    """DCP's save planner, but a ``BytesIO`` value is written as it is (DCP would
    ``torch.save`` the BytesIO object itself): a small entry holds ``torch.save``'s bytes
    of sailfin's state, which ``torch.load(weights_only=True)`` reads back."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class BytesAsGiven(DefaultSavePlanner):
        def transform_object(self, write_item: Any, object: Any) -> Any:
            if isinstance(object, io.BytesIO):
                return object
            return super().transform_object(write_item, object)

    return BytesAsGiven()


class DcpWriter:
    """Writes a save on every rank with one ``dcp.save``; an async save is copied by DCP's
    stagers (:mod:`.staging`) and written by the run's one writer thread, on a process
    group of its own. ``then`` (rank 0: the commit) runs once the save is on storage.

    Example (on every rank)::

        writer = DcpWriter(storage, {})
        writer.save("ckpt/.tmp-step-00000010", {"module": model_sd}, async_save=False,
                    then=lambda: print(writer.described()))      # rank 0
    """

    def __init__(self, storage: Storage, storage_options: Optional[dict] = None,
                 make_writer: Optional[Callable[[str], Any]] = None) -> None:
        self.storage = storage
        self.storage_options = storage_options or {}
        self.make_writer = make_writer or self.writer
        self._pending: Optional[Future] = None
        self._keys: list[str] = []
        self._staging = ""  # the save being written
        self._group: Any = None
        self._stager: Optional[SplitStager] = None  # async saves' copies and writer thread
        self._thread: Optional[ThreadPoolExecutor] = None
        self._writer_used: Any = None  # rank 0's holds every file's checksum after the save

    def save(self, staging: str, state: dict[str, Any], async_save: bool, step: int = 0,
             later: frozenset = frozenset(), then: Optional[Callable[[], None]] = None
             ) -> None:
        """``later``: storages an async save may copy until :meth:`settle`."""
        import torch.distributed as dist

        self.wait()
        path = self.storage.join(staging, SHARDS)
        if not dist.is_initialized() or dist.get_rank() == 0:
            # Shards of a killed save of this step (perhaps on more ranks) go first.
            self.storage.remove_tree(path)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # no rank makes the folder while rank 0 still removes the old one
        self.storage.makedirs(path)
        self._keys = sorted(k for k, v in state.items() if not isinstance(v, io.BytesIO))
        self._staging = staging
        self._writer_used = writer = self.make_writer(path)
        if not async_save:
            self._save(state, writer, None)
            if then is not None:
                then()
            return
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")  # every rank saves: collective is fine
        if self._stager is None:  # its CPU copies are reused from save to save
            self._stager = SplitStager(pinned=torch.cuda.is_available())
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="sailfin-dcp-save")
        staged, fill = self._stager.stage(state, later, step)  # ``later``: by the thread
        self._pending = self._thread.submit(self._write, staged, fill, writer, then)

    def _save(self, state: dict[str, Any], writer: Any, group: Any) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            with _one_process_is_meant():
                dcp.save(state, storage_writer=writer, planner=_save_planner(),
                         process_group=group)
        except (Exception, CheckpointException) as exc:  # every rank gets DCP's failure
            raise write_failure(self.storage, self.storage.join(self._staging, SHARDS),
                                 exc) from None

    def _write(self, staged: dict[str, Any], fill: Callable[[], None], writer: Any,
               then: Optional[Callable[[], None]]) -> None:
        try:  # a copy that failed or is not the save's state: this rank's writer refuses, so
            fill()  # DCP fails the save on every rank (none hangs) and rank 0 never commits
            if self._stager is not None and not self._stager.consistent():
                writer.refusal = self._stager.refusal()
        except Exception as exc:
            writer.refusal = f"copying the optimizers' state to CPU memory failed: {exc}"
        self._save(staged, writer, self._group)
        if then is not None:
            then()

    def settle(self) -> bool:
        """See :meth:`.staging.SplitStager.settle`."""
        return self._stager is not None and self._stager.settle()

    def wait(self) -> None:
        """Block until this rank's last save (and its ``then``) is done; raise if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._stager is not None and self._thread is not None:
                self._thread.shutdown(wait=True)
                self._stager.close()
                self._stager = self._thread = None

    def described(self) -> dict[str, Any]:
        """Rank 0, once the save is on storage: the manifest's ``sharded`` entry (every
        rank's files and small entries with their checksums)."""
        writer = self._writer_used
        sums, entries = writer.sailfin_checksums, writer.sailfin_entries
        listed = set(self.storage.listdir(self.storage.join(self._staging, SHARDS)))
        if set(sums) != listed:  # a file no rank reported, or one reported but absent
            raise CheckpointError(f"the shards in {self.storage.display(self._staging)} are "
                                  f"{sorted(listed)}, the ranks wrote {sorted(sums)}: put "
                                  "trainer.checkpoint.dir (or trainer.output_dir) on storage "
                                  "every rank shares")
        return {"format": FORMAT, "dir": SHARDS, "keys": self._keys, "files": describe(sums),
                "entries": {key: {**FileEntry(size, crc).to_json(), "file": file}
                            for key, (size, crc, file) in sorted(entries.items())}}

    def writer(self, path: str) -> Any:
        """The DCP storage writer for ``path`` (checksummed; local or fsspec)."""
        import torch.distributed.checkpoint as dcp

        if isinstance(self.storage, LocalStorage):
            writer = checksummed_writer(dcp.FileSystemWriter, path, single_file_per_rank=True)
        else:
            writer = checksummed_writer(fsspec_writer(), self.storage.display(path),
                                        **self.storage_options)
        writer.sailfin_written = {}  # each file's checksum, counted as DCP writes it
        # (and a full disk is one line, on Python 3.13 too)
        return streams_flushable_after_close(writer, writer.sailfin_written)


@dataclasses.dataclass
class ShardedRef:
    """Where a loaded checkpoint's shards are; :func:`load_sharded` reads the model and
    optimizers, :func:`read_small` sailfin's small entries."""

    storage: Storage
    path: str
    keys: list[str]
    storage_options: dict
    entries: dict[str, FileEntry] = dataclasses.field(default_factory=dict)
    """The small entries (``trainer``, ``rng/rank0000N``) and their checksums."""
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    """Which shard file holds each small entry."""

    def reader(self) -> Any:
        import torch.distributed.checkpoint as dcp

        if isinstance(self.storage, LocalStorage):
            return restricted_reader(dcp.FileSystemReader, self.path)
        return restricted_reader(fsspec_reader(), self.storage.display(self.path),
                                 **self.storage_options)

    def file_of(self, key: str) -> str:
        """The shard file that holds the small entry ``key``, as shown to the user."""
        return self.storage.display(self.storage.join(self.path, self.files.get(key, "")))

    def where(self, key: str) -> str:
        """The small entry ``key`` as a place to name: its shard file and key."""
        return f"{self.file_of(key)} (entry {key!r})"


def locate_shards(storage: Storage, where: str, manifest: dict[str, Any],
                  storage_options: Optional[dict] = None, rank: int = 0,
                  world_size: int = 1) -> Optional[ShardedRef]:
    """The checkpoint's shards (None if it has none), checked against the manifest: see
    :func:`.shard_checksums.verify`."""
    info = manifest.get("sharded")
    if not info:
        return None
    shown = storage.display(where)
    if not isinstance(info, dict) or not plain_name(info.get("dir", SHARDS)):
        raise CheckpointCorrupt(f"checkpoint manifest in {shown} has a malformed 'sharded' "
                                "entry (its dir must be a name inside the checkpoint)", shown)
    if info.get("format") != FORMAT:
        raise CheckpointCorrupt(f"checkpoint {shown} holds shards in format "
                                f"{info.get('format')!r}; this sailfin reads {FORMAT!r}", shown)
    path = storage.join(where, info.get("dir", SHARDS))
    files = info.get("files") or {}
    try:
        if not isinstance(files, dict):
            raise TypeError(files)
        verify(storage, path, files, rank, world_size)
        check_index(storage, path, files)
        listed = info.get("entries") or {}
        entries = {key: FileEntry(e["size"], int(e["crc32"], 16)) for key, e in listed.items()}
        held = {key: e.get("file") for key, e in listed.items() if plain_name(e.get("file"))}
    except (KeyError, TypeError, ValueError, AttributeError):
        raise CheckpointCorrupt(f"checkpoint manifest in {shown} has a malformed shard list",
                                shown) from None
    return ShardedRef(storage, path, list(info.get("keys", [])), dict(storage_options or {}),
                      entries, held)


def read_small(ref: ShardedRef, keys: Iterable[str]) -> dict[str, Any]:
    """The small entries ``keys`` that the manifest lists, each checked against its CRC-32
    and read with ``weights_only``; this rank alone (no collective: a rank reads before
    every rank agrees the checkpoint is sound)."""
    wanted = {key: None for key in keys if key in ref.entries}
    if not wanted:
        return {}

    reading: list[str] = []  # the entry being read: an error names it

    def check(key: str, data: io.BytesIO) -> None:
        reading.append(key)
        entry, got = ref.entries[key], FileEntry.of(data.getbuffer())
        if got != entry:
            raise CheckpointCorrupt(f"checkpoint entry {ref.where(key)} does not match its "
                                    "CRC-32 in the manifest: it was altered or damaged after "
                                    "it was saved", ref.file_of(key))
    from torch.distributed.checkpoint.api import CheckpointException

    try:  # a TypeError or the like of this code (not DCP's per-rank failure) passes as is
        with _one_process_is_meant():
            dcp_load(wanted, ref.reader(), local=True, check=check)
    except (CheckpointException, CheckpointCorrupt) as exc:
        key = reading[-1] if reading else None
        raise _refused(ref, exc, key) from None
    return wanted


def load_sharded(ref: ShardedRef, module: torch.nn.Module,
                 optimizers: list[torch.optim.Optimizer],
                 callbacks: Optional[dict[str, Any]] = None,
                 skip: Iterable[str] = ()) -> dict[str, Any]:
    """The saved ``module`` and ``optimizers`` state, cut for this run's backend and world
    size: DCP reads into PyTorch's distributed state dicts the rows each rank needs.
    ``callbacks`` (name -> object with ``state_dict()``): the state of those saved in DCP
    comes back as ``{"callbacks": {name: state}}`` (a callback this run lacks is not
    read). ``skip``: model entries the checkpoint does not hold (a frozen base)."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)

    skipped = frozenset(skip)
    targets: dict[str, Callable[[], Any]] = {
        "module": lambda: {k: v for k, v in get_model_state_dict(module).items()
                           if k not in skipped},
        "optimizers": lambda: {str(i): get_optimizer_state_dict(module, opt)
                               for i, opt in enumerate(optimizers)},
    }
    for name, callback in (callbacks or {}).items():
        targets[f"{CALLBACKS}/{name}"] = callback.state_dict
    keys = [k for k in ref.keys if not (k.startswith(CALLBACKS + "/") and k not in targets)]
    unknown = [k for k in keys if k not in targets]
    if unknown:
        raise CheckpointError(f"checkpoint shards {ref.storage.display(ref.path)} hold "
                              f"{unknown}, which this sailfin does not know how to load")
    state = {key: targets[key]() for key in keys}
    try:  # a TypeError or the like of this code (not DCP's per-rank failure) passes as is
        with _one_process_is_meant():
            dcp_load(state, ref.reader())
    except CheckpointException as exc:  # DCP names the missing or mismatched key
        raise _refused(ref, exc) from None
    if "optimizers" in state:
        state["optimizers"] = [state["optimizers"][str(i)] for i in range(len(optimizers))]
    loaded_callbacks = {k.split("/", 1)[1]: state.pop(k) for k in list(state)
                        if k.startswith(CALLBACKS + "/")}
    if loaded_callbacks:
        state[CALLBACKS] = loaded_callbacks
    return state


def _refused(ref: ShardedRef, exc: BaseException, key: Optional[str] = None
             ) -> CheckpointError:
    """A failed DCP read (of the small entry ``key``, else of the shards) as one line:
    damage (a checksum, a value only arbitrary unpickling could rebuild) is
    :class:`CheckpointCorrupt`; anything else does not fit this run."""
    shown = ref.storage.display(ref.path)
    what, file = (f"entry {ref.where(key)}", ref.file_of(key)) if key else (shown, shown)
    inner = list(per_rank(exc).values()) or [exc]
    damaged = next((e for e in inner if isinstance(e, CheckpointCorrupt)), None)
    if damaged is not None:
        return damaged
    refused = next((e for e in inner if isinstance(e, pickle.UnpicklingError)), None)
    if refused is not None:
        found = re.search(r"GLOBAL ([\w.]+)", str(refused))
        needs = f" (it needs {found.group(1)})" if found else ""
        return CheckpointCorrupt(f"checkpoint {'shards ' if not key else ''}{what} holds a "
                                 f"value that only arbitrary unpickling could rebuild{needs}: "
                                 "it was rewritten after the save, and is not loaded, since "
                                 "unpickling can run any code", file)
    if key:
        return CheckpointCorrupt(f"checkpoint {what} cannot be read ({reason(exc)}): it is "
                                 "damaged", file)
    return CheckpointError(f"the shards in {shown} do not fit this model: {reason(exc)}")
