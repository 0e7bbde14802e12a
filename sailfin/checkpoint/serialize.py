"""Reading checkpoint files safely: each opened only once it is known to be a regular file
inside the checkpoint, and (an earlier release's ``trainer.pt`` and ``rng-rank*.pt``)
loaded with ``weights_only`` torch.load.

Each file's size and CRC-32 are in the manifest and are checked before anything is
unpickled: CRC-32 finds truncation and damage at several GB/s,
and a cryptographic hash would protect nothing more (whoever can rewrite a file can
rewrite the manifest too). A checkpoint file may have been replaced by a named pipe, a
link to ``/dev/zero`` or a directory, and a manifest may name ``../../etc/hostname``:
every read goes through :func:`open_checked`.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import io
import os
import pickle
import re
import stat
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterator, Optional

import torch

from ..utils.crc import crc32
from ..utils.files import file_kind
from ..utils.voice import say
from .errors import CheckpointCorrupt, CheckpointError
from .storage import Storage

# What a manifest may name: one plain file name, never a path.
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")

#: A file at least this large is announced before it is read to check it (a resume
#: that reads many gigabytes says why it takes a while).
SAY_ABOVE_BYTES = 1 << 30


def plain_name(name: object) -> bool:
    """True for a file name a manifest may list: no directory part, no ``..``, no NUL."""
    return isinstance(name, str) and len(name) <= 255 and bool(_PLAIN_NAME.match(name))


def plain_shard_name(name: object) -> bool:
    """A sharded checkpoint's file name: a plain name, or DCP's index ``.metadata``."""
    return name == ".metadata" or plain_name(name)


def _why(exc: OSError, local: str) -> str:
    """What ``local`` is, when opening it failed with ``exc``."""
    if exc.errno == errno.ELOOP:
        return "a loop of symbolic links"
    try:
        return f"it is {file_kind(os.lstat(local).st_mode)}"
    except OSError:
        return exc.strerror or str(exc)


@contextlib.contextmanager
def open_checked(storage: Storage, path: str, shown: str, *, what: str = "checkpoint file",
                 expected_size: Optional[int] = None, limit: Optional[int] = None,
                 within: Optional[str] = None) -> Iterator[BinaryIO]:
    """Open ``path`` once it is known to be a regular file of ``expected_size`` (the
    manifest's) or at most ``limit`` bytes, whose real path lies in ``within``. Raises
    :class:`CheckpointCorrupt` naming ``shown``; FileNotFoundError passes through."""
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
    except FileNotFoundError:
        raise
    except OSError as exc:  # a socket (ENXIO), a symbolic-link loop (ELOOP), an I/O error
        raise CheckpointCorrupt(f"{what} {shown} cannot be opened ({_why(exc, local)}): the "
                                "checkpoint is damaged or was tampered with", shown) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointCorrupt(f"{what} {shown} is {file_kind(info.st_mode)}, not a regular "
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
    """The bytes of a small file (a manifest, a pointer): see :func:`open_checked`."""
    with open_checked(storage, path, shown, what=what, limit=limit, within=within) as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:  # grew since it was measured
        _check_size(len(data), shown, what, None, limit)
    return data


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.Size)


@dataclass(frozen=True)
class FileEntry:
    """What the manifest records of one file."""

    size: int
    crc32: int

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "crc32": f"{self.crc32:08x}"}

    @classmethod
    def of(cls, data: bytes) -> "FileEntry":
        return cls(len(data), crc32(data))


def load_object(storage: Storage, path: str, entry: FileEntry, mmap: bool = False,
                within: Optional[str] = None) -> Any:
    """Read ``path`` (see :func:`open_checked`), check it against the manifest, and load it
    without arbitrary unpickling (``mmap``: a local file's tensors are read when touched)."""
    shown = storage.display(path)
    local = storage.local_path(path)
    try:
        with open_checked(storage, path, shown, expected_size=entry.size, within=within) as fh:
            if local is not None:  # check it in chunks, then let torch read the file: 1x memory
                crc = checksum_stream(fh)[1]
                source: Any = local
            else:
                data = fh.read()
                crc, source = crc32(data), io.BytesIO(data)
    except FileNotFoundError:
        raise CheckpointCorrupt(f"checkpoint file {shown} is missing (the manifest lists it)",
                                shown) from None
    if crc != entry.crc32:  # (open_checked compared the size)
        raise CheckpointCorrupt(f"checkpoint file {shown} does not match its CRC-32 in the "
                                "manifest: it was altered or damaged after it was saved", shown)
    try:
        return torch.load(source, map_location="cpu", weights_only=True,
                          mmap=mmap and local is not None)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f" (it needs {found.group(1)})" if found else ""
        # Saves refuse such objects (check_plain): the file was rewritten after the save.
        raise CheckpointCorrupt(
            f"checkpoint file {shown} holds Python objects that only arbitrary unpickling could "
            f"rebuild{what}: it was rewritten after the save (sailfin refuses to save them), and "
            "is not loaded, since unpickling can run any code", shown) from None
    except (RuntimeError, ValueError, EOFError, OSError) as exc:  # a damaged zip archive
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointCorrupt(f"checkpoint file {shown} matches its checksum but torch.load "
                                f"cannot read it ({reason}): it is damaged", shown) from None


def checksum_stream(stream: Any, update: Callable[..., int] = crc32) -> tuple[int, int]:
    """(size, checksum) of what ``stream`` holds from its current position."""
    size, crc = 0, 0
    while chunk := stream.read(16 << 20):
        size += len(chunk)
        crc = update(chunk, crc)
    return size, crc


def check_plain(obj: Any, where: str) -> None:
    """Refuse, at save time, anything ``weights_only`` loading could not read back."""
    stack = [(obj, where)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, torch.Tensor) or type(value) in _PLAIN:
            continue
        if type(value) in (dict, collections.OrderedDict):
            for k, v in value.items():
                if type(k) not in _PLAIN:
                    raise CheckpointError(f"{path} has a key of type {type(k).__name__}; "
                                          "checkpoint keys must be str, int, float or bool")
                stack.append((v, f"{path}[{k!r}]"))
        elif type(value) in (list, tuple, set, frozenset):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))
        else:
            raise CheckpointError(
                f"{path} is a {type(value).__module__}.{type(value).__qualname__}, which a "
                "checkpoint cannot hold: checkpoints are loaded with torch.load(weights_only="
                "True), which rebuilds only tensors and plain Python types (dict, list, tuple, "
                "set, str, int, float, bool, None). Convert it, e.g. to a dict of those")
