"""Replacing a local file whole: the one atomic writer of every small file sailfin keeps
(checkpoint pointers and manifests, ``metrics.jsonl`` after a resume, the time account).

Example::

    replace_file("outputs/run/time_account.json", b"{...}\\n", durable=False)
"""

from __future__ import annotations

import contextlib
import os
import stat


def replace_file(path: str, data: bytes, durable: bool = True) -> None:
    """Write ``data`` to a temporary name beside ``path`` and rename it over ``path``: a
    reader sees the old file or the new one, never part of one. ``durable``: fsync the
    file and its directory (survives a power cut; without, a killed process)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
    except OSError:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)  # a full disk: leave no partial file behind
        raise
    os.replace(tmp, path)
    if durable:
        fsync_dir(os.path.dirname(path))


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in directory ``path`` survive a power cut."""
    if not hasattr(os, "O_DIRECTORY"):
        return  # Windows cannot open a directory to fsync it
    fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def file_kind(mode: int) -> str:
    """What a file of ``mode`` (``os.stat``'s ``st_mode``) is that is not a regular file,
    for a message: "a directory", "a FIFO (named pipe)", a device, "a socket"."""
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")
