"""Start-up checks for where a writer writes: fail in the first second, not hours in."""

from __future__ import annotations

import contextlib
import os
import time

from .writers import WriterError

# Enough to need a fresh block on any file system: a full disk refuses it.
_PROBE_BYTES = 64 * 1024
# A directory proven writable this recently is not probed again: the trainer's output
# check and a file writer's check of the same directory happen in one set-up.
_PROVEN_SECONDS = 5.0
_proven: dict[str, float] = {}


def check_directory(directory: str, writer: str, key: str = "trainer.output_dir",
                    who: "str | None" = None) -> None:
    """Create ``directory`` if needed and prove a file can be written there.

    Writes, syncs and removes a small probe file, so a path through a file, a
    read-only or permission-denied directory, a full disk or an exhausted quota
    all raise :class:`WriterError` naming ``writer`` (or ``who``), the path and
    ``key``.
    """
    who = who or f"the {writer} writer"
    proven = _proven.get(os.path.abspath(directory))
    if proven is not None and time.monotonic() - proven < _PROVEN_SECONDS \
            and os.path.isdir(directory):
        return
    probe = os.path.join(directory, f".sailfin-write-probe-{os.getpid()}")
    blocker = _file_in_the_way(directory)
    if blocker is not None:
        raise WriterError(f"{who} cannot write to {directory}: {blocker} is a "
                          f"file, not a directory; change {key}")
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"\0" * _PROBE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise destination_error(writer, directory, exc, key, who) from None
    finally:
        with contextlib.suppress(OSError):
            os.remove(probe)
    _proven[os.path.abspath(directory)] = time.monotonic()


def destination_error(writer: str, path: str, exc: OSError, key: str,
                      who: "str | None" = None) -> WriterError:
    reason = exc.strerror or str(exc)
    error = WriterError(f"{who or f'the {writer} writer'} cannot write to {path}: {reason}; "
                        f"fix the path or free space on its disk, or change {key}")
    error.errno = exc.errno
    return error


def _file_in_the_way(directory: str) -> "str | None":
    """The path's nearest existing ancestor (or itself) if it is not a directory."""
    path = os.path.abspath(directory)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return None if os.path.isdir(path) else path
