"""The trainer: the loop (core/), optional features (features/), run safety (safety/)
and the trainer's side of checkpoints (checkpointing/)."""

from .core.callbacks import Callback
from .core.trainer import Trainer

__all__ = ["Callback", "Trainer"]
