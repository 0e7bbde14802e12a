"""Checkpoints: save every stateful piece, atomically, locally or at any fsspec URL.

Storage only: the trainer builds a :class:`Checkpointer` from ``trainer.checkpoint``
and hands it named state; resuming lives in ``sailfin.trainer.checkpointing``.
"""

from __future__ import annotations

import os
from typing import Callable

from ..config.checkpoint import CheckpointArguments
from ..config.errors import ConfigError
from ..config.memory import persisting_args
from ..config.trainer import TrainerArguments
from ..distributed import DistEnv
from .checkpointer import Checkpointer, DirectoryCheckpointer, Loaded, SaveRequest
from .errors import CheckpointCorrupt, CheckpointError

__all__ = ["CheckpointArguments", "CheckpointCorrupt", "CheckpointError", "Checkpointer",
           "DirectoryCheckpointer", "Loaded", "SaveRequest", "build_checkpointer"]


def build_checkpointer(args: TrainerArguments, dist: DistEnv,
                       barrier: Callable[[], None] = lambda: None) -> Checkpointer:
    """The checkpointer ``args.checkpoint`` asks for, at its ``dir`` (default
    ``<output_dir>/checkpoints``). Memory snapshots (``trainer.checkpoint.memory``) are a
    callback of the trainer's, over :mod:`.snapshots`."""
    ckpt = persisting_args(args.checkpoint)  # memory.persist_every_n_steps: async saves
    location = ckpt.dir or os.path.join(args.output_dir, "checkpoints")
    cls: type = DirectoryCheckpointer
    if ckpt.class_path:
        from ..config.loader import ComponentSpec

        cls = ComponentSpec(ckpt.class_path).resolve("trainer.checkpoint")
        if not (isinstance(cls, type) and issubclass(cls, Checkpointer)):
            raise ConfigError(f"trainer.checkpoint.class_path {ckpt.class_path} is not a "
                              "subclass of sailfin.checkpoint.Checkpointer")
    return cls(location, ckpt, dist, barrier)
