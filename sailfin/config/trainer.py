"""The ``trainer:`` section of a config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from .errors import ConfigError

WRITERS = ("stdout", "jsonl", "csv", "tensorboard", "mlflow")


@dataclass
class TrainerArguments:
    """Everything the trainer needs to know, typed and validated.

    Example::

        args = TrainerArguments(epochs=3, train_batch_size=64, micro_batch_size=32)
        Trainer(module, args).train()
    """

    epochs: int = 1
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps in all (null: no cap)."""
    max_train_steps_per_epoch: Optional[int] = None
    train_batch_size: int = 32
    """GLOBAL batch: the samples behind one optimizer step, over all devices."""
    micro_batch_size: Optional[int] = None
    """Samples per device per forward (memory limit). Null: the global batch over the world size."""
    val_batch_size: Optional[int] = None
    """Per-device validation batch. Null: the micro batch size."""
    drop_last: bool = False
    """Drop an epoch's last, smaller global batch instead of stepping on it."""
    shuffle: bool = True
    backend: str = "sp"
    device: str = "auto"
    """``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda``, ``cuda:1``..."""
    seed: int = 42
    output_dir: str = "outputs"
    max_grad_norm: Optional[float] = None
    """Clip the global gradient norm to this value (null: no clipping)."""
    log_every_n_steps: int = 10
    val_every_n_epochs: int = 1
    """Validate after every N-th epoch and after the last (0: only when asked)."""
    writers: list[str] = field(default_factory=lambda: ["stdout", "jsonl"])
    """Where metrics go: any of stdout, jsonl, csv, tensorboard, mlflow (rank 0 only)."""
    mlflow_tracking_uri: Optional[str] = None
    """MLflow store. Null: MLFLOW_TRACKING_URI if set, else sqlite:///<output_dir>/mlflow.db."""
    mlflow_experiment: str = "sailfin"
    progress: Literal["auto", "bar", "lines", "none"] = "auto"
    """``bar`` (a terminal progress bar), ``lines`` (plain periodic lines), ``none``;
    ``auto``: a bar when stderr is a terminal, else lines."""
    progress_interval: float = 30.0
    """Seconds between plain progress lines (``lines`` mode)."""
    best_metric: Optional[str] = None
    """Validation metric whose best value (and step) the summary reports, e.g.
    ``accuracy`` or ``test/accuracy`` with several validation sets. Null: ``loss`` if
    validation reports one."""
    best_mode: Literal["min", "max"] = "min"
    profile_steps: Optional[list[int]] = None
    """``[start, end]``: record a torch profiler trace of optimizer steps start..end."""

    # PyMarlin's names for the same settings.
    _aliases = {"gpu_batch_size_limit": "micro_batch_size"}

    def __post_init__(self) -> None:
        positive = ["epochs", "train_batch_size", "log_every_n_steps"]
        optional_positive = ["max_steps", "max_train_steps_per_epoch", "micro_batch_size",
                             "val_batch_size"]
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        for name in optional_positive:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"trainer.{name} must be >= 1 or null, got {value}")
        if self.val_every_n_epochs < 0:
            raise ConfigError(
                f"trainer.val_every_n_epochs must be >= 0, got {self.val_every_n_epochs}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ConfigError(
                f"trainer.max_grad_norm must be > 0 or null (no clipping), got {self.max_grad_norm}")
        for i, name in enumerate(self.writers):
            if name not in WRITERS:
                from .errors import suggest
                raise ConfigError(
                    f"trainer.writers[{i}] is '{name}'{suggest(name, WRITERS)}; "
                    f"available writers: {', '.join(WRITERS)}")
        if len(set(self.writers)) != len(self.writers):
            raise ConfigError(f"trainer.writers lists a writer twice: {self.writers}")
        if not self.progress_interval > 0:
            raise ConfigError(
                f"trainer.progress_interval must be > 0 seconds, got {self.progress_interval}")
        if self.best_metric is None and self.best_mode != "min":
            raise ConfigError("trainer.best_mode is set but trainer.best_metric is null: "
                              "name the validation metric, e.g. best_metric: accuracy")
        steps = self.profile_steps
        if steps is not None and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
            raise ConfigError(
                f"trainer.profile_steps must be [start, end] with 1 <= start <= end "
                f"(optimizer steps, counted from 1), got {steps}")
