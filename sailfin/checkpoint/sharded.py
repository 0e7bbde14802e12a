"""Model and optimizer state on every backend, with DCP: each rank writes and reads its own rows.

The model and optimizers go to ``<checkpoint>/shards`` through
``torch.distributed.checkpoint`` (DCP), under the names PyTorch's distributed state dicts
give them; DCP re-cuts the rows on load, so a checkpoint resumes on any world size and
backend (docs/checkpoints-and-resume.md shows the layout). The manifest, written last,
lists the shards with their CRC-32s. torch alone opens it::

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save("step-00000120/shards", "step-120.pt")   # {"module": ..., "optimizers": ...}
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import pickle
import re
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from ..compat.torch import (dcp_load, fsspec_reader, fsspec_writer,
                            streams_flushable_after_close)
from .errors import (CheckpointCorrupt, CheckpointError, CheckpointWriteError, errno_of,
                     per_rank)
from .serialize import plain_name
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


def _failures() -> tuple[type[BaseException], ...]:
    """What a DCP call raises: its CheckpointException (one error per failed rank) derives
    from BaseException. Imported when needed: torch.distributed.checkpoint takes a second."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


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
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, kind):
            return True
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return False


class ShardedWriter:
    """Writes a save's sharded state on every rank with ``dcp.save``; an async save is
    copied by DCP's stagers (:mod:`.staging`) and written by the run's one writer thread,
    on a process group of its own.

    Example (on every rank)::

        writer = ShardedWriter(storage, {})
        writer.save("ckpt/.tmp-step-00000010", {"module": model_sd}, async_save=False)
        facts = writer.finish("ckpt/.tmp-step-00000010")      # rank 0, before the manifest
    """

    def __init__(self, storage: Storage, storage_options: Optional[dict] = None) -> None:
        self.storage = storage
        self.storage_options = storage_options or {}
        self._pending: Optional[Future] = None
        self._keys: list[str] = []
        self._staging: Optional[str] = None  # the save whose shards are being written
        self._failed: Optional[tuple[str, str]] = None  # (save, why) its shards failed
        self._group: Any = None
        self._stager: Optional[SplitStager] = None  # async saves' copies and writer thread
        self._thread: Optional[ThreadPoolExecutor] = None
        self._writer_used: Any = None  # rank 0's holds every file's checksum after the save

    def save(self, staging: str, state: dict[str, Any], async_save: bool, step: int = 0,
             later: frozenset = frozenset()) -> None:
        """``later``: storages an async save may copy until :meth:`settle`."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        self.wait()
        path = self.storage.join(staging, SHARDS)
        if not dist.is_initialized() or dist.get_rank() == 0:
            # Shards of a killed save of this step (perhaps on more ranks) go first.
            self.storage.remove_tree(path)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # no rank makes the folder while rank 0 still removes the old one
        self.storage.makedirs(path)
        self._keys, self._staging, self._failed = sorted(state), staging, None
        self._writer_used = writer = self._writer(path)
        if not async_save:
            try:
                with _one_process_is_meant():
                    dcp.save(state, storage_writer=writer)
            except _failures() as exc:  # every rank gets DCP's CheckpointException
                raise _write_failure(self.storage, path, exc) from None
            return
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")  # every rank saves: collective is fine
        if self._stager is None:  # its CPU copies are reused from save to save
            self._stager = SplitStager(pinned=torch.cuda.is_available())
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="sailfin-dcp-save")
        staged, fill = self._stager.stage(state, later, step)  # ``later``: by the thread
        self._pending = self._thread.submit(self._write, staged, fill, writer)

    def _write(self, staged: dict[str, Any], fill: Callable[[], None], writer: Any) -> None:
        import torch.distributed.checkpoint as dcp

        try:  # a copy that failed or is not the save's state: this rank's writer refuses, so
            fill()  # DCP fails the save on every rank (none hangs) and rank 0 never commits
            if self._stager is not None and not self._stager.consistent():
                writer.refusal = self._stager.refusal()
        except Exception as exc:
            writer.refusal = f"copying the optimizers' state to CPU memory failed: {exc}"
        dcp.save(staged, storage_writer=writer, process_group=self._group)

    def settle(self) -> bool:
        """See :meth:`.staging.SplitStager.settle`."""
        return self._stager is not None and self._stager.settle()

    def wait(self) -> None:
        """Block until this rank's last shards are on storage; raise if writing failed."""
        # Two threads may wait (rank 0's background commit and the next save): clear
        # the future only once it is done, so neither goes on before the shards are written.
        pending = self._pending
        if pending is None:
            return
        try:
            pending.result()
        except _failures() as exc:
            failure = _write_failure(self.storage, self.storage.join(self._staging or "",
                                                                     SHARDS), exc)
            self._failed = (self._staging, str(failure))  # the other waiter must know too
            raise failure from None
        finally:
            if self._pending is pending:
                self._pending = None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._stager is not None and self._thread is not None:
                self._thread.shutdown(wait=True)
                self._stager.close()
                self._stager = self._thread = None

    def finish(self, staging: str) -> Optional[dict[str, Any]]:
        """Rank 0, before the manifest: wait for every rank's shards and the index, and
        describe them (None when the save in ``staging`` wrote no shards)."""
        if staging != self._staging:
            return None
        self.wait()
        if self._failed is not None and self._failed[0] == staging:  # seen by the other
            raise CheckpointError(self._failed[1])                    # waiter first
        sums = self._writer_used.sailfin_checksums
        listed = set(self.storage.listdir(self.storage.join(staging, SHARDS)))
        if set(sums) != listed:  # a file no rank reported, or one reported but absent
            raise CheckpointError(f"the shards in {self.storage.display(staging)} are "
                                  f"{sorted(listed)}, the ranks wrote {sorted(sums)}: put "
                                  "trainer.checkpoint.dir (or trainer.output_dir) on storage "
                                  "every rank shares")
        return {"format": FORMAT, "dir": SHARDS, "keys": self._keys, "files": describe(sums)}

    def _writer(self, path: str) -> Any:
        import torch.distributed.checkpoint as dcp

        if isinstance(self.storage, LocalStorage):
            writer = checksummed_writer(dcp.FileSystemWriter, path, single_file_per_rank=True)
        else:
            writer = checksummed_writer(fsspec_writer(), self.storage.display(path),
                                        **self.storage_options)
        return streams_flushable_after_close(writer)  # a full disk: one line, on 3.13 too


@dataclasses.dataclass
class ShardedRef:
    """Where a loaded checkpoint's shards are; :func:`load_sharded` reads them."""

    storage: Storage
    path: str
    keys: list[str]
    storage_options: dict

    def reader(self) -> Any:
        import torch.distributed.checkpoint as dcp

        if isinstance(self.storage, LocalStorage):
            return restricted_reader(dcp.FileSystemReader, self.path)
        return restricted_reader(fsspec_reader(), self.storage.display(self.path),
                                 **self.storage_options)


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
    except (KeyError, TypeError, ValueError):
        raise CheckpointCorrupt(f"checkpoint manifest in {shown} has a malformed shard list",
                                shown) from None
    return ShardedRef(storage, path, list(info.get("keys", [])), dict(storage_options or {}))


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
        shown = ref.storage.display(ref.path)
        refused = [e for e in per_rank(exc).values()
                   if isinstance(e, (CheckpointCorrupt, pickle.UnpicklingError))]
        if refused:
            found = re.search(r"GLOBAL ([\w.]+)", str(refused[0]))
            needs = f" (it needs {found.group(1)})" if found else ""
            raise CheckpointCorrupt(f"checkpoint shards {shown} hold a value that only "
                                    f"arbitrary unpickling could rebuild{needs}: they were "
                                    "rewritten after the save, and are not loaded, since "
                                    "unpickling can run any code", shown) from None
        raise CheckpointError(f"the shards in {shown} do not fit this model: "
                              f"{_reason(exc)}") from None
    if "optimizers" in state:
        state["optimizers"] = [state["optimizers"][str(i)] for i in range(len(optimizers))]
    loaded_callbacks = {k.split("/", 1)[1]: state.pop(k) for k in list(state)
                        if k.startswith(CALLBACKS + "/")}
    if loaded_callbacks:
        state[CALLBACKS] = loaded_callbacks
    return state


def _write_failure(storage: Storage, path: str, exc: BaseException) -> CheckpointWriteError:
    """DCP's failure to write shards, as one line; a full disk (torch.save reports it as
    ``unexpected pos``, the OSError lost) is told by the space left there."""
    code = errno_of(exc)
    if code is None and _full(storage, path):
        code = errno.ENOSPC
    reason = "no space left on device" if code == errno.ENOSPC else _reason(exc)
    failure = CheckpointWriteError(f"writing the checkpoint shards in {storage.display(path)} "
                                   f"failed: {reason}", storage.display(path), code)
    failure.every_rank = True  # DCP's save is collective: every rank gets its failure
    return failure


def _full(storage: Storage, path: str) -> bool:
    """Whether the local file system holding ``path`` has (almost) no space left."""
    local = storage.local_path(path)
    if local is None:
        return False
    while local and not os.path.exists(local):
        local = os.path.dirname(local)
    try:
        stat = os.statvfs(local or "/")
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize < 1 << 20  # less than 1 MiB: what failed was full


def _reason(exc: BaseException) -> str:
    """DCP's per-rank errors without their tracebacks (it puts those in the message)."""
    failures = per_rank(exc)
    if not failures:
        return str(exc)
    return "; ".join(f"rank {rank}: {type(inner).__name__}: {inner}"
                     for rank, inner in sorted(failures.items()))
