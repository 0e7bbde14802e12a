"""The process that writes memory snapshots, out of the training process.

Serialising a snapshot and computing its CRC-32s in the training process would
compete with training for the interpreter and the cores. So a writer process per
rank, at the lowest priority, maps the staging files (:mod:`.memory_staging`) and
writes the snapshot from them; only a small description of the state crosses the
pipe. If the training process is gone before the rename, the snapshot stays
unfinished, never complete.

Example::

    described, _ = staging.stage({"model": model.state_dict()})   # copied at once
    writer = WriterProcess()
    writer.write(directory, "step-00000012", described, facts, staging.directory)
    writer.close()
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
from concurrent.futures import Future
from typing import Any, BinaryIO, Callable, Iterator, Optional

import torch

from . import manifest as manifests
from .memory_staging import rebuild, remove_file
from .serialize import FileEntry, save_object
from .storage import LocalStorage


class _InPlace(LocalStorage):
    """Writes a file over its old bytes (then cuts it to the new length) instead of
    replacing it: on a RAM file system its pages are reused. No fsync: memory is all
    there is to reach."""

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        try:
            fh = open(path, "r+b")
        except FileNotFoundError:
            fh = open(path, "wb")
        with fh:
            yield fh
            fh.truncate()


def write_snapshot(directory: str, name: str, staged: dict[str, Any], facts: dict[str, Any],
                   staging_dir: str, mapped: dict[str, torch.UntypedStorage],
                   parent: Optional[int] = None,
                   commit: Optional[Callable[[], bool]] = None) -> bool:
    """Write ``staged`` (stem -> state described by :class:`SharedStaging`) as the snapshot
    ``directory/name``: the files under ``.tmp-<name>`` (an older snapshot's, rewritten in
    place), the manifest last, then the rename, unless the training process ``parent`` is
    gone or ``commit()`` (asked once the files are written) says no. True when renamed.
    ``mapped`` (staging file name -> its mapping) keeps the staging files mapped from one
    snapshot to the next (mapping 24 MB anew faults in every page again)."""
    storage = _InPlace()
    temporary = os.path.join(directory, f".tmp-{name}")
    os.makedirs(temporary, exist_ok=True)
    remove_file(os.path.join(temporary, manifests.MANIFEST))
    used: dict[str, torch.UntypedStorage] = {}
    files: dict[str, FileEntry] = {}
    for stem, described in staged.items():
        obj = rebuild(described, staging_dir, mapped, used)
        # One core: the writer checksums on its own thread, not on training's core too.
        files[f"{stem}.pt"] = save_object(storage, os.path.join(temporary, f"{stem}.pt"), obj,
                                          overlap=False)
    for gone in set(mapped) - set(used):
        del mapped[gone]
    for leftover in set(os.listdir(temporary)) - set(files):
        remove_file(os.path.join(temporary, leftover))
    with open(os.path.join(temporary, manifests.MANIFEST), "wb") as fh:
        fh.write(manifests.encode(facts, files))
    if commit is not None and not commit():
        shutil.rmtree(temporary, ignore_errors=True)  # not the state of one step
        return False
    if parent is not None and os.getppid() != parent:
        return False  # the training process died: its last snapshot stays unfinished
    final = os.path.join(directory, name)
    shutil.rmtree(final, ignore_errors=True)  # a snapshot of this step from before a restart
    os.rename(temporary, final)
    return True


def _serve(parent: int) -> None:
    """The writer process: one snapshot per message on stdin until ``None`` or the pipe
    ends; each answered on stdout (None: renamed; ``"dropped"``; or the error's errno and
    reason). A snapshot sent with ``hold`` is answered ``"written"`` once its files are,
    and renamed only if the next message says True."""
    torch.set_num_threads(1)
    # Each file's CRC-32 is computed as it is written and kept in the manifest, which is
    # what a restart checks; torch.save's own CRC-32 of every zip record (torch.load never
    # checks it) would double the work: half of a snapshot's write time. This process only
    # writes snapshots, so the setting (process-wide) touches nothing else.
    torch.serialization.set_crc32_options(False)
    # Background work: where it and training want the same core, training goes first.
    os.nice(19)
    # A signal to the job (torchrun's SIGTERM to the process group, Ctrl-C) is the
    # training process's to handle; this one ends when that one closes its pipe or dies.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print must not land among the replies
    jobs = sys.stdin.buffer
    mapped: dict[str, torch.UntypedStorage] = {}  # the staging files, kept mapped

    def send(reply: Any) -> None:
        try:
            pickle.dump(reply, replies)
            replies.flush()
        except OSError:  # BrokenPipeError: the training process is gone, nobody to tell
            sys.stderr.flush()
            os._exit(0)

    def commit() -> bool:
        send("written")
        try:
            return pickle.load(jobs) is True
        except (EOFError, OSError):
            return False  # the training process is gone: the snapshot stays unfinished

    send("ready")  # torch is imported: snapshots can come
    while True:
        try:
            job = pickle.load(jobs)
        except (EOFError, OSError):
            job = None  # the training process is gone
        if job is None:
            # Nothing is left to tear down, and the interpreter's own teardown (torch's)
            # would hold the training process's close() for a third of a second.
            sys.stderr.flush()
            os._exit(0)
        *where, hold = job
        try:
            renamed = write_snapshot(*where, mapped, parent, commit if hold else None)
            reply: Any = None if renamed else "dropped"
        except BaseException as exc:  # noqa: BLE001 - sent back, raised in the trainer
            reply = (_errno(exc), f"{type(exc).__name__}: {exc}")
        send(reply)


def _errno(exc: Optional[BaseException]) -> Optional[int]:
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc.errno
        exc = exc.__cause__
    return None


class Verdict:
    """Whether a snapshot copied while training went on holds its step's state: given by
    :meth:`MemoryStore.settle`, waited for by the writer thread before the rename."""

    def __init__(self) -> None:
        self._given: Future = Future()
        self.written = threading.Event()  # the files are written, the rename waits
        self.renamed = threading.Event()  # the writer is done with it (renamed or not)

    def give(self, unchanged: bool) -> None:
        self._given.set_result(unchanged)

    def wait(self) -> bool:
        self.written.set()
        return self._given.result()


class WriterProcess:
    """A process that writes this rank's snapshots (started at the first one)."""

    def __init__(self) -> None:
        self._proc: Any = None
        self._ready = False

    def write(self, directory: str, name: str, staged: dict[str, Any], facts: dict[str, Any],
              staging_dir: str, verdict: Optional[Callable[[], bool]] = None) -> bool:
        """:func:`write_snapshot` in the writer; True when renamed. Raises OSError (errno
        kept: a full file system) or RuntimeError."""
        self.ready()
        try:
            self._send((directory, name, staged, facts, staging_dir, verdict is not None))
            reply = pickle.load(self._proc.stdout)
            if reply == "written" and verdict is not None:
                self._send(verdict())
                reply = pickle.load(self._proc.stdout)
        except (EOFError, OSError):
            raise RuntimeError("the memory snapshot writer process died") from None
        if reply is None or reply == "dropped":
            return reply is None
        code, reason = reply
        if code is not None:
            raise OSError(code, f"memory snapshot writer: {reason}")
        raise RuntimeError(f"memory snapshot writer: {reason}")

    def _send(self, message: Any) -> None:
        pickle.dump(message, self._proc.stdin)
        self._proc.stdin.flush()

    def ready(self) -> None:
        """Start the writer if it is not running, and wait until it can write."""
        self.start()
        if self._ready:
            return
        try:
            hello = pickle.load(self._proc.stdout)
        except (EOFError, OSError):
            hello = None
        if hello != "ready":
            raise RuntimeError("the memory snapshot writer process did not start (exit code "
                               f"{self._proc.poll()}); its error is above")
        self._ready = True

    def start(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self._ready = False
        # A fresh interpreter (not fork: the training process has threads), importing
        # this sailfin; it needs no more than one thread.
        package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join(filter(None, [package, os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from sailfin.checkpoint.memory_writer import "
             "_serve; _serve(int(sys.argv[1]))", str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)

    def close(self) -> None:
        """Stop the writer (after the snapshot it is writing)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            pickle.dump(None, proc.stdin)
            proc.stdin.close()
        except (OSError, ValueError):
            pass
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()

