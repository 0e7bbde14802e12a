"""Reading checkpoint files that may not be what they claim.

A file in a checkpoint may have been replaced by a named pipe (opening it waits for
a writer forever), a symlink to ``/dev/zero`` (reading it never ends) or a directory,
and a manifest may name ``../../etc/hostname``. Every read of a checkpoint goes
through here: it takes only plain file names from a manifest, opens a local file
without blocking, checks on the open descriptor that it is a regular file whose real
path lies inside the checkpoint directory, and compares its size with what the
manifest promised (or a bound) before reading a byte.

Example::

    with open_checked(storage, path, shown, expected_size=4211, within=step_dir) as fh:
        data = fh.read()
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from typing import BinaryIO, Iterator, Optional

from ..utils.voice import say
from .errors import CheckpointCorrupt
from .storage import Storage

# What a manifest may name: one plain file name, never a path.
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))

#: A file at least this large is announced before it is read to check it (a resume
#: that reads many gigabytes says why it takes a while).
SAY_ABOVE_BYTES = 1 << 30


def plain_name(name: object) -> bool:
    """True for a file name a manifest may list: no directory part, no ``..``, no NUL."""
    return isinstance(name, str) and len(name) <= 255 and bool(_PLAIN_NAME.match(name))


def plain_shard_name(name: object) -> bool:
    """A sharded checkpoint's file name: a plain name, or DCP's index ``.metadata``."""
    return name == ".metadata" or plain_name(name)


def _kind(mode: int) -> str:
    for test, what in _KINDS:
        if test(mode):
            return what
    return "not a regular file"


@contextlib.contextmanager
def open_checked(storage: Storage, path: str, shown: str, *, what: str = "checkpoint file",
                 expected_size: Optional[int] = None, limit: Optional[int] = None,
                 within: Optional[str] = None) -> Iterator[BinaryIO]:
    """Open ``path`` for reading once it is known to be a regular file of the right size.

    ``expected_size``: the manifest's size (a mismatch is damage); ``limit``: the most
    bytes such a file may hold; ``within``: the directory its real path must lie in.
    Raises :class:`CheckpointCorrupt` naming ``shown``; FileNotFoundError passes through.
    """
    local = storage.local_path(path)
    if local is None:
        with _open_remote(storage, path, shown, what, expected_size, limit) as fh:
            yield fh
        return
    try:
        # O_NONBLOCK: opening a FIFO does not wait for a writer; the fstat below refuses it.
        fd = os.open(local, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except (IsADirectoryError, NotADirectoryError):
        raise CheckpointCorrupt(f"{what} {shown} is a directory, not a regular file: the "
                                "checkpoint is damaged", shown) from None
    except PermissionError as exc:
        raise CheckpointCorrupt(f"{what} {shown} cannot be read ({exc.strerror}): give this "
                                "user read permission, or move the checkpoint away",
                                shown) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointCorrupt(f"{what} {shown} is {_kind(info.st_mode)}, not a regular "
                                    "file: the checkpoint is damaged or was tampered with",
                                    shown)
        if within is not None:
            real, root = os.path.realpath(local), os.path.realpath(within)
            if os.path.commonpath([real, root]) != root:
                raise CheckpointCorrupt(f"{what} {shown} is a link to {real}, outside the "
                                        f"checkpoint directory {within}: sailfin reads "
                                        "checkpoint files only inside it", shown)
        _check_size(info.st_size, shown, what, expected_size, limit)
        if info.st_size >= SAY_ABOVE_BYTES:  # checking it takes a while: say so first
            say(f"checking {what} {shown} ({info.st_size / 2 ** 20:,.0f} MiB) against its "
                "checksum before loading it")
        if hasattr(os, "O_NONBLOCK"):
            os.set_blocking(fd, True)
        fh = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with fh:
        yield fh  # type: ignore[misc]


@contextlib.contextmanager
def _open_remote(storage: Storage, path: str, shown: str, what: str,
                 expected_size: Optional[int], limit: Optional[int]) -> Iterator[BinaryIO]:
    try:
        _check_size(storage.size(path), shown, what, expected_size, limit)
        with storage.open_read(path) as fh:
            yield fh
    except (IsADirectoryError, NotADirectoryError):
        raise CheckpointCorrupt(f"{what} {shown} is a directory, not a file: the checkpoint "
                                "is damaged", shown) from None


def _check_size(size: int, shown: str, what: str, expected: Optional[int],
                limit: Optional[int]) -> None:
    if expected is not None and size != expected:
        raise CheckpointCorrupt(f"{what} {shown} has {size} bytes; the manifest says "
                                f"{expected}: it is truncated or was overwritten", shown)
    if limit is not None and size > limit:
        raise CheckpointCorrupt(f"{what} {shown} has {size} bytes, more than the {limit} such "
                                "a file can hold: it is damaged or not a sailfin checkpoint",
                                shown)


def read_checked(storage: Storage, path: str, shown: str, *, what: str, limit: int,
                 within: Optional[str] = None) -> bytes:
    """The bytes of a small file (a manifest, a pointer), refused when larger than ``limit``
    or not a regular file."""
    with open_checked(storage, path, shown, what=what, limit=limit, within=within) as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:  # grew since it was measured
        _check_size(len(data), shown, what, None, limit)
    return data
