"""Checkpoint errors. Each message names the checkpoint or file and says what to do."""

from __future__ import annotations

import errno
import os
from typing import Any, Iterator, Optional


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or used as it is. ``every_rank`` is True when every
    rank raised it together (a collective write of sharded state failed)."""

    every_rank = False


class CheckpointCorrupt(CheckpointError):
    """A checkpoint file is missing, truncated or altered since it was saved; ``resume:
    auto`` falls back to the next older complete checkpoint."""

    def __init__(self, message: str, file: str) -> None:
        super().__init__(message)
        self.file = file


class CheckpointWriteError(CheckpointError):
    """A checkpoint file could not be written (full disk, lost mount...); ``errno`` says why."""

    def __init__(self, message: str, file: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.file = file
        self.errno = errno


def causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, what caused it, and each rank's failure that DCP's CheckpointException
    collected, in turn (a bounded walk: 50 at most)."""
    stack, seen = [exc], 0
    while stack and seen < 50:
        item, seen = stack.pop(), seen + 1
        yield item
        stack.extend(per_rank(item).values())
        stack.extend(x for x in (item.__cause__, item.__context__) if x is not None)


def per_rank(exc: BaseException) -> dict[int, BaseException]:
    """DCP's CheckpointException's failure of each rank (it pairs each with a traceback)."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return {}
    return {rank: failure[0] if isinstance(failure, tuple) else failure
            for rank, failure in failures.items()}


def errno_of(exc: BaseException) -> Optional[int]:
    """The first errno among :func:`causes` of ``exc`` (an OSError's, or the one a
    :class:`CheckpointWriteError` kept)."""
    return next((e.errno for e in causes(exc) if isinstance(getattr(e, "errno", None), int)),
                None)


def no_space(exc: BaseException) -> bool:
    """Whether ``exc`` comes from a full disk (ENOSPC, or a quota: EDQUOT)."""
    return errno_of(exc) in (errno.ENOSPC, getattr(errno, "EDQUOT", -1))


def write_failure(storage: Any, path: str, exc: BaseException) -> CheckpointWriteError:
    """DCP's failure to write shards, as one line; a full disk (torch.save reports it as
    ``unexpected pos``, the OSError lost) is told by the space left there."""
    code = errno_of(exc)
    if code is None and _full(storage, path):
        code = errno.ENOSPC
    why = "no space left on device" if code == errno.ENOSPC else reason(exc)
    failure = CheckpointWriteError(f"writing the checkpoint shards in {storage.display(path)} "
                                   f"failed: {why}", storage.display(path), code)
    failure.every_rank = True  # DCP's save is collective: every rank gets its failure
    return failure


def _full(storage: Any, path: str) -> bool:
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


def reason(exc: BaseException) -> str:
    """DCP's per-rank errors without their tracebacks (it puts those in the message)."""
    failures = per_rank(exc)
    if not failures:
        return str(exc)
    return "; ".join(f"rank {rank}: {type(inner).__name__}: {inner}"
                     for rank, inner in sorted(failures.items()))
