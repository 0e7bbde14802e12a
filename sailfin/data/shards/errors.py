"""The one error type of shard reading and writing."""

from __future__ import annotations

from typing import Optional


class ShardError(RuntimeError):
    """Bad or unreachable shard data. The message names the shard URL and, where one is
    involved, the sample key and byte offset, and says what to do.

    It takes the message as its only positional argument so that DataLoader workers
    can re-raise it in the main process unchanged.
    """

    def __init__(self, message: str, url: Optional[str] = None, key: Optional[str] = None,
                 offset: Optional[int] = None) -> None:
        super().__init__(message)
        self.url, self.key, self.offset = url, key, offset


class ShardURLError(ShardError, ValueError):
    """A shard list that names no shard, or one that is refused (``pipe:``)."""


def where(url: str, key: Optional[str] = None, offset: Optional[int] = None) -> str:
    """``shard URL, sample 'KEY' at byte N``: the start of every data error message."""
    text = f"shard {url}"
    if key is not None:
        text += f", sample '{key}'"
    if offset is not None:
        text += f" at byte {offset}"
    return text
