"""The trainer: the loop, validation, callbacks and run outputs."""

from .callbacks import Callback
from .trainer import Trainer

__all__ = ["Callback", "Trainer"]
