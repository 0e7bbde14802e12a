"""The ``trainer.checkpoint.memory:`` section: snapshots in shared memory every N steps."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from .errors import ConfigError


@dataclass
class MemorySnapshotArguments:
    """Memory snapshots: each rank's state in shared memory (``/dev/shm``), every N steps.

    A snapshot survives its worker's death, so a restarted worker resumes from
    the last step instead of the last disk checkpoint. See docs/memory-snapshots.md.

    Example::

        args = TrainerArguments(checkpoint=CheckpointArguments(
            memory=MemorySnapshotArguments(every_n_steps=1, replicas=1)))
    """

    every_n_steps: Union[int, Literal["auto"], None] = None
    """Snapshot every N optimizer steps (null: off; 1: every step); ``auto``: N chosen from
    the measured snapshot and step times and the failure rate (docs/goodput.md)."""
    dir: Optional[str] = None
    """A directory on a RAM file system; null: /dev/shm/sailfin-<run id>-node<N>."""
    persist_every_n_steps: Optional[int] = None
    """Also write an ordinary checkpoint every N steps (with the async path); null: never."""
    replicas: int = 0
    """1: also keep each rank's snapshot in the memory of a rank on another node."""

    def __post_init__(self) -> None:
        if isinstance(self.every_n_steps, str) and self.every_n_steps != "auto":
            raise ConfigError(f"trainer.checkpoint.memory.every_n_steps must be a number, auto "
                              f"or null, got {self.every_n_steps!r}")
        for name in ("every_n_steps", "persist_every_n_steps"):
            value = getattr(self, name)
            if value is not None and value != "auto" and value < 1:
                raise ConfigError(f"trainer.checkpoint.memory.{name} must be >= 1 or null, "
                                  f"got {value}")
        if self.replicas not in (0, 1):
            raise ConfigError(f"trainer.checkpoint.memory.replicas must be 0 or 1, got "
                              f"{self.replicas}")
        if self.dir is not None and not self.dir.strip():
            raise ConfigError("trainer.checkpoint.memory.dir is empty; give a directory on a "
                              "RAM file system, or null for /dev/shm")
        if self.dir is not None and "://" in self.dir:
            raise ConfigError(f"trainer.checkpoint.memory.dir must be a local directory (a "
                              f"tmpfs such as /dev/shm), got {self.dir!r}")

    @property
    def enabled(self) -> bool:
        return self.every_n_steps is not None


def persisting_args(checkpoint: Any) -> Any:
    """``trainer.checkpoint`` as the disk checkpointer takes it: with
    ``memory.persist_every_n_steps`` its saves are async."""
    memory = checkpoint.memory
    if memory.enabled and memory.persist_every_n_steps and not checkpoint.async_save:
        return dataclasses.replace(checkpoint, async_save=True)
    return checkpoint
