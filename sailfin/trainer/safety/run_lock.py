"""A run owns its output directory: rank 0 holds an OS file lock (``fcntl.flock`` on
``<output_dir>/.sailfin.lock``, naming its owner) for the run's life, so a second run
into the directory stops at once. The kernel releases it when the process dies, however
it dies; which file systems lock across nodes: docs/robustness.md."""

from __future__ import annotations

import json
import os
import socket
import time
from typing import IO, Any, Callable, Optional

from ...utils.voice import say

LOCK_NAME = ".sailfin.lock"
GRACE_SECONDS = 5.0  # how long a busy lock is waited for before it is another run's


class RunLockError(RuntimeError):
    """Another run holds the output directory; the message names it and what to do."""


class RunLock:
    """The exclusive lock of one output directory: ``acquire()`` (RunLockError if another
    run has it), then ``release()``."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, LOCK_NAME)
        self._file: Optional[IO[str]] = None
        self.took_over: Optional[dict[str, Any]] = None
        """The owner a dead run left in the file, when this run took its lock over."""

    def acquire(self, grace_seconds: float = GRACE_SECONDS) -> "RunLock":
        """Take the lock; a holder still there after ``grace_seconds`` is another run."""
        import fcntl

        os.makedirs(self.output_dir, exist_ok=True)
        fh = open(self.path, "a+", encoding="utf-8")
        deadline = time.monotonic() + grace_seconds
        try:
            while True:
                try:
                    fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    # A run killed a moment ago holds it until its process is gone (a
                    # restart under torchrun, a re-run right after kill -9): wait a little.
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(0.1)
        except BlockingIOError:
            owner = _read_owner(fh)
            fh.close()
            raise RunLockError(
                f"trainer.output_dir {self.output_dir} is in use by another run "
                f"({_describe(owner)}): two runs in one directory would mix their "
                "checkpoints and metrics. Wait for it to end or stop it, or choose another "
                "trainer.output_dir") from None
        except OSError as exc:  # a file system without locks
            fh.close()
            raise RunLockError(
                f"cannot lock trainer.output_dir {self.output_dir} ({exc.strerror}): its "
                "file system does not support file locks; put the output directory on one "
                "that does (see docs/robustness.md)") from None
        # Held from here: a stop (SIGTERM during set-up raises) from now on is released
        # by release(), which empties the owner line; no "took over" at the next start.
        self._file = fh
        previous = _read_owner(fh)
        self.took_over = previous or None
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                             "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
        return self

    def release(self) -> None:
        """Empty the owner line and let go: the next run starts without a takeover note."""
        fh, self._file = self._file, None
        if fh is None:
            return
        try:
            fh.seek(0)
            fh.truncate()
            fh.flush()
        finally:
            fh.close()  # closing the descriptor releases the flock


def take_run_lock(output_dir: str, is_main: bool, keep: Callable[[RunLock], None]) -> None:
    """Rank 0 locks ``output_dir``; say so when a dead run's lock is taken over.
    ``keep(lock)`` is called before the lock is taken: the caller holds the object to
    release even when a stop (an exception raised by a signal handler) lands while it
    is being taken."""
    if not is_main:
        return
    from ...logging.destination import check_directory

    # A path through a file, a read-only directory...: the writer's clear message first.
    check_directory(output_dir, "output", who="sailfin (summary.json, final weights, checkpoints)")
    lock = RunLock(output_dir)
    keep(lock)
    lock.acquire()
    if lock.took_over:
        say(f"took over the lock of {output_dir} from a run that is no longer running "
            f"({_describe(lock.took_over)}); it ended without releasing it (killed?)")


def _read_owner(fh: IO[str]) -> dict[str, Any]:
    fh.seek(0)
    text = fh.read().strip()
    if not text:
        return {}
    try:
        owner = json.loads(text)
    except ValueError:
        return {"raw": text[:200]}
    return owner if isinstance(owner, dict) else {"raw": text[:200]}


def _describe(owner: dict[str, Any]) -> str:
    if not owner:
        return "owner unknown: it has not written its name yet"
    if "raw" in owner:
        return f"owner {owner['raw']!r}"
    return (f"pid {owner.get('pid')} on host {owner.get('host')}, started "
            f"{owner.get('started')}")
