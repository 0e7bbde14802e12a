"""Checkpoint errors. Each message names the checkpoint or file and says what to do."""

from __future__ import annotations


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
