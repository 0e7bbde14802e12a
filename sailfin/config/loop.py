"""The ``trainer.early_stopping:`` and ``trainer.ema:`` sections."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

from .errors import ConfigError, short_repr


@dataclass
class EarlyStoppingArguments:
    """Stop training after ``patience`` validations in a row without improvement (off
    while ``metric`` is null): an improvement beats the best so far by more than
    ``min_delta`` (below it for ``mode: min``, above it for ``max``).

    Example::

        args = TrainerArguments(early_stopping=EarlyStoppingArguments(
            metric="loss", mode="min", patience=3, min_delta=1e-4))
    """

    metric: Optional[str] = None
    """A validation metric: ``loss``, or ``<set>/<metric>`` with several validation sets."""
    mode: Literal["min", "max"] = "min"
    """Whether a lower (min) or higher (max) metric is an improvement."""
    patience: int = 3
    """Validations without improvement before the run stops."""
    min_delta: float = 0.0
    """Smallest change that counts as an improvement."""

    def __post_init__(self) -> None:
        if self.metric is not None and not self.metric.strip("/"):
            raise ConfigError("trainer.early_stopping.metric is empty; name a validation metric "
                              "such as 'loss' or 'val/accuracy', or use null (off)")
        if self.mode not in ("min", "max"):
            raise ConfigError(f"trainer.early_stopping.mode must be 'min' or 'max', "
                              f"got {short_repr(self.mode)}")
        if isinstance(self.patience, bool) or self.patience < 1:
            raise ConfigError(f"trainer.early_stopping.patience must be >= 1 validations, "
                              f"got {self.patience}")
        if not (math.isfinite(self.min_delta) and self.min_delta >= 0):
            raise ConfigError(f"trainer.early_stopping.min_delta must be >= 0, "
                              f"got {self.min_delta}")

    @property
    def enabled(self) -> bool:
        return self.metric is not None


@dataclass
class EmaArguments:
    """An exponential moving average of the weights, kept beside them (off while
    ``decay`` is null).

    Example::

        args = TrainerArguments(ema=EmaArguments(decay=0.999, validate=True))
    """

    decay: Optional[float] = None
    """In (0, 1); e.g. 0.999 (an average over about 1 / (1 - decay) updates). Null: off."""
    every_n_steps: int = 1
    """Update the average every N optimizer steps."""
    warmup: bool = False
    """Use min(decay, (1 + n) / (10 + n)) for the n-th update (off: decay from the start)."""
    validate: bool = False
    """Validate with the averaged weights (swapped in for validation, then back)."""

    def __post_init__(self) -> None:
        if self.decay is not None and not 0.0 < self.decay < 1.0:
            raise ConfigError(f"trainer.ema.decay must be in (0, 1) (e.g. 0.999), or null (off); "
                              f"got {self.decay}")
        if isinstance(self.every_n_steps, bool) or self.every_n_steps < 1:
            raise ConfigError(f"trainer.ema.every_n_steps must be >= 1, got {self.every_n_steps}")

    @property
    def enabled(self) -> bool:
        return self.decay is not None
