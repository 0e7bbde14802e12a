"""The ``trainer.checkpoint:`` section: when checkpoints are saved, where, and how many are kept."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from .errors import ConfigError
from .memory import MemorySnapshotArguments


@dataclass
class CheckpointArguments:
    """When and where the trainer saves checkpoints.

    Example::

        args = TrainerArguments(checkpoint=CheckpointArguments(every_n_steps=500, keep_last=3,
                                                               best_metric="accuracy",
                                                               best_mode="max"))
    """

    dir: Optional[str] = None
    """A local directory or an fsspec URL (``s3://bucket/run``); null: <output_dir>/checkpoints."""
    every_n_steps: Union[int, Literal["auto"], None] = None
    """Save every N optimizer steps (null: not by step count); ``auto``: N chosen from the
    measured save and step times and the failure rate (Young-Daly; docs/goodput.md)."""
    mtbf_hours: Optional[float] = None
    """Mean time between failures for ``every_n_steps: auto``; null: the failure rate this
    run has seen (24 h until its first failure)."""
    at_epoch_end: bool = True
    """Save at the end of every epoch (after its validation)."""
    best_metric: Optional[str] = None
    """Save when this validation metric improves: ``accuracy``, or ``<set>/<metric>``."""
    best_mode: Literal["min", "max"] = "min"
    """Whether a lower (min) or higher (max) best_metric is better."""
    keep_last: Optional[int] = 3
    """Keep the newest N checkpoints (plus the best); null keeps every one."""
    async_save: bool = False
    """Copy the state to CPU memory and write it in the background (``async`` is an alias)."""
    storage_options: dict = field(default_factory=dict)
    """Passed to fsspec for a URL ``dir`` (``{client_kwargs: {endpoint_url: ...}}``)."""
    class_path: Optional[str] = None
    """A ``Checkpointer`` subclass (``package.module.Class``) to use instead of the default."""
    memory: MemorySnapshotArguments = field(default_factory=MemorySnapshotArguments)
    """Snapshots in shared memory every N steps (see docs/memory-snapshots.md)."""

    _aliases = {"async": "async_save"}

    def __post_init__(self) -> None:
        if isinstance(self.memory, dict):  # CheckpointArguments(memory={...}) from Python
            from .coerce import build_dataclass
            self.memory = build_dataclass(MemorySnapshotArguments, self.memory,
                                          prefix="trainer.checkpoint.memory.")
        if isinstance(self.every_n_steps, str) and self.every_n_steps != "auto":
            raise ConfigError(f"trainer.checkpoint.every_n_steps must be a number, auto or "
                              f"null, got {self.every_n_steps!r}")
        if self.mtbf_hours is not None and not self.mtbf_hours > 0:
            raise ConfigError(f"trainer.checkpoint.mtbf_hours must be > 0 hours or null (the "
                              f"failure rate this run has seen), got {self.mtbf_hours}")
        for name in ("every_n_steps", "keep_last"):
            value = getattr(self, name)
            if value is not None and value != "auto" and value < 1:
                raise ConfigError(f"trainer.checkpoint.{name} must be >= 1 or null, got {value}")
        if self.dir is not None and not self.dir.strip():
            raise ConfigError("trainer.checkpoint.dir is empty; give a directory or URL, or "
                              "null for <output_dir>/checkpoints")
        if self.best_metric is not None and not self.best_metric.strip("/"):
            raise ConfigError("trainer.checkpoint.best_metric is empty; name a validation "
                              "metric such as 'accuracy' or 'val/accuracy', or use null")
        if self.class_path is not None and "." not in self.class_path:
            raise ConfigError(f"trainer.checkpoint.class_path must be 'package.module.ClassName', "
                              f"got {self.class_path!r}")
        if self.storage_options and (self.dir is None or not is_url(self.dir)):
            raise ConfigError("trainer.checkpoint.storage_options are for a URL dir (s3://..., "
                              f"gs://...); dir {self.dir!r} is local")

    @property
    def saves(self) -> bool:
        """Whether anything triggers a save."""
        return bool(self.every_n_steps or self.at_epoch_end or self.best_metric)


def is_url(path: str) -> bool:
    """``s3://b/x`` and ``memory://x`` are URLs; local paths and ``file://`` are not."""
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme not in ("", "file") and "/" not in scheme


def check_resume(value: str) -> None:
    """``trainer.resume`` is auto, never, or a path; an empty string is a mistake."""
    if not value.strip():
        raise ConfigError("trainer.resume is empty; use auto, never, or the path of a checkpoint")
