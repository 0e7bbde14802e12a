"""The trainer: the loop (core/), optional features (features/), run safety (safety/),
the trainer's side of checkpoints (checkpointing/), and the composition root that
builds a run from its config (compose/). Features see the run as a RunView."""

from .compose.trainer import Trainer
from .core.callbacks import Callback
from .core.view import RunView

__all__ = ["Callback", "RunView", "Trainer"]
