"""The trainer: the loop (core/), features/, safety/, checkpointing/ and the composition
root that builds a run from its config (compose/)."""

from .compose.trainer import Trainer
from .core.callbacks import Callback
from .core.view import RunView

__all__ = ["Callback", "RunView", "Trainer"]
