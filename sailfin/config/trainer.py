"""The ``trainer:`` section of a config."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional, Union, get_args, get_type_hints

from .checkpoint import CheckpointArguments, check_resume
from .coerce import build_dataclass
from .distributed import DistArguments
from .dp import DPArguments, is_private
from .errors import ConfigError, short_repr, suggest
from .fsdp import FSDPArguments
from .loop import EarlyStoppingArguments, EmaArguments

WRITERS = ("stdout", "jsonl", "csv", "tensorboard", "mlflow")

# trainer.backend: name -> (strategy, precision). PyMarlin's names are aliases for
# compositions; sailfin.backends builds them, and `sailfin train --help` lists them.
BACKEND_ALIASES: dict[str, tuple[str, str]] = {
    "sp": ("single", "fp32"),
    "sp-amp": ("single", "amp"),
    "sp-amp-apex": ("single", "amp"),
    "ddp": ("ddp", "fp32"),
    "ddp-amp": ("ddp", "amp"),
    "fsdp": ("fsdp", "fp32"),
    "fsdp-amp": ("fsdp", "amp"),
}
# DP-SGD composed on a name above (sailfin.backends.dp); any other "<name>-dp" is refused
# there with the reason.
PRIVATE_BACKENDS: tuple[str, ...] = ("sp-dp", "ddp-dp", "fsdp-dp")
BACKENDS: tuple[str, ...] = (*BACKEND_ALIASES, *PRIVATE_BACKENDS)
"""Every ``trainer.backend`` name sailfin builds: the one list the errors and the help show."""


@dataclass
class TrainerArguments:
    """Everything the trainer needs to know, typed and validated.

    Example::

        args = TrainerArguments(epochs=3, train_batch_size=64, micro_batch_size=32)
        Trainer(module, args).train()
    """

    epochs: int = 1
    """Passes over the training set."""
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps in all (null: no cap)."""
    max_train_steps_per_epoch: Optional[int] = None
    """Cap on optimizer steps per epoch (null: the whole training set)."""
    train_batch_size: int = 32
    """GLOBAL batch: the samples behind one optimizer step, over all devices."""
    micro_batch_size: Union[int, Literal["auto"], None] = None
    """Samples per device per forward (memory limit). Null: the global batch over the world
    size. ``auto``: the largest size that fits, found by retrying a step that runs out of
    memory with the next smaller size (the global batch never changes)."""
    val_batch_size: Optional[int] = None
    """Per-device validation batch. Null: the micro batch size."""
    drop_last: bool = False
    """Drop an epoch's last, smaller global batch instead of stepping on it."""
    shuffle: bool = True
    """Shuffle the training order each epoch (a function of seed and epoch)."""
    backend: str = "auto"
    """How a step runs (a strategy x a precision); one of BACKENDS (the help lists them).
    auto: ddp when a launcher started several processes (torchrun, Slurm, MPI: world size
    above 1), else sp; the backend in effect is printed and saved with the run."""
    amp_dtype: Literal["auto", "bfloat16", "float16"] = "auto"
    """Autocast type of the ``*-amp`` backends. auto: bfloat16 where the device supports it
    (CPU included), else float16 (with loss scaling)."""
    compile: bool = False
    """Run ``train_step`` through ``torch.compile`` (compiled once, at the first step)."""
    compile_mode: Literal["default", "reduce-overhead", "max-autotune",
                          "max-autotune-no-cudagraphs"] = "default"
    """torch.compile's mode (with compile)."""
    # -- compile check: is torch.compile paying? (trainer/features/speed_checks.py) --
    compile_check: bool = True
    """With ``compile``: after warm-up, time a few compiled steps against the same number
    run eagerly (once, at fixed global steps) and warn when compiling does not pay."""
    activation_checkpointing: list[str] = field(default_factory=list)
    """Class names of submodules whose activations are recomputed in backward, not stored."""
    on_nonfinite: Literal["stop", "skip", "warn"] = "stop"
    """What a NaN/inf loss does: stop the run, skip that optimizer step, or warn and go on."""
    device: str = "auto"
    """``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda``, ``cuda:1``..."""
    seed: int = 42
    """Seeds the data order and every random stream (per rank)."""
    output_dir: str = "outputs"
    """Where metrics, checkpoints, summary.json and final weights go."""
    max_grad_norm: Optional[float] = None
    """Clip the global gradient norm to this value (null: no clipping)."""
    log_every_n_steps: int = 10
    """Log the train loss (one host-device sync) every N optimizer steps."""
    val_every_n_epochs: int = 1
    """Validate after every N-th epoch and after the last (0: only when asked)."""
    writers: list[str] = field(default_factory=lambda: ["stdout", "jsonl"])
    """Where metrics go: any of stdout, jsonl, csv, tensorboard, mlflow (rank 0 only)."""
    mlflow_tracking_uri: Optional[str] = None
    """MLflow store. Null: MLFLOW_TRACKING_URI if set, else sqlite:///<output_dir>/mlflow.db."""
    mlflow_experiment: str = "sailfin"
    """MLflow experiment name (the mlflow writer)."""
    progress: Literal["auto", "bar", "lines", "none"] = "auto"
    """``bar`` (a terminal progress bar), ``lines`` (plain periodic lines), ``none``;
    ``auto``: a bar when stderr is a terminal, else lines."""
    progress_interval: float = 30.0
    """Seconds between plain progress lines (``lines`` mode)."""
    profile_steps: Optional[list[int]] = None
    """``[start, end]``: record a torch profiler trace of optimizer steps start..end."""
    resume: str = "auto"
    """``auto``: continue from the latest complete checkpoint, if any; ``never``; or a path."""
    checkpoint: CheckpointArguments = field(default_factory=CheckpointArguments)
    distributed: DistArguments = field(default_factory=DistArguments)
    """Rank discovery and process-group settings (``ddp`` backends)."""
    # Preemption (SIGTERM / first Ctrl-C: save and stop; see docs/multinode.md).
    preemption_check_every_n_steps: int = 10
    """With several ranks, how often (optimizer steps) they agree whether a SIGTERM came: one
    all-reduce of one number each time; the stop lands at most this many steps after it."""
    # -- validation every N steps, early stopping, EMA weights, FLOPs and MFU ------------
    val_every_n_steps: Optional[int] = None
    """Also validate every N optimizer steps (null: only as val_every_n_epochs says)."""
    early_stopping: EarlyStoppingArguments = field(default_factory=EarlyStoppingArguments)
    """Stop after ``patience`` validations without improvement (off while ``metric`` is null)."""
    ema: EmaArguments = field(default_factory=EmaArguments)
    """An exponential moving average of the weights (off while ``decay`` is null)."""
    count_flops: bool = True
    """Count the model FLOPs of the first step; log achieved TFLOP/s (and MFU)."""
    peak_tflops: Optional[float] = None
    """Peak dense TFLOP/s of one device, for MFU (null: from a table of known GPUs)."""
    # Sharded data parallel (the fsdp backends).
    fsdp: FSDPArguments = field(default_factory=FSDPArguments)
    """Which submodules the ``fsdp`` backends shard as units; see docs/sharding.md."""
    dp: DPArguments = field(default_factory=DPArguments)
    """Differential privacy of the ``*-dp`` backends (DP-SGD on Opacus); see docs/dp.md."""

    # -- resume checks, starting from weights, PyMarlin's meanings, start-up checks --------
    gpu_batch_size_limit: Optional[int] = None
    """PyMarlin's ceiling on the micro batch: the micro batch is the largest size within it
    that the global batch and world size allow (``micro_batch_size`` is exact instead)."""
    max_val_steps_per_epoch: Optional[int] = None
    """Validate on at most this many batches per validation set and rank (null: all)."""
    sanity_val_batches: int = 1
    """Validation batches run through ``val_step`` before the first training step, to catch
    a broken ``val_step`` at once (0: off). Draws nothing from the training's random streams."""
    threads: Optional[int] = None
    """CPU intra-op threads per process (null: ``OMP_NUM_THREADS``, else torch's count up
    to the CPUs the process may use under sp, cores / local processes under ddp/fsdp)."""
    init_from: Optional[str] = None
    """Start a new run from these weights only (a checkpoint directory, a directory of them,
    or a ``.safetensors`` file); not used when ``resume`` finds a checkpoint of this run."""
    resume_config: Literal["check", "accept"] = "check"
    """On resume, a config that differs from the checkpoint's in keys that define the
    training stops the run (``check``); ``accept`` takes the new values and says which."""

    def __post_init__(self) -> None:
        positive = ["epochs", "train_batch_size", "log_every_n_steps",
                    "preemption_check_every_n_steps"]
        optional_positive = ["max_steps", "max_train_steps_per_epoch", "micro_batch_size",
                             "threads",
                             "val_batch_size", "gpu_batch_size_limit", "max_val_steps_per_epoch",
                             "val_every_n_steps"]
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        for name in optional_positive:
            value = getattr(self, name)
            if name == "micro_batch_size" and value == "auto":
                continue  # micro_batch_size: auto (sailfin.trainer.autobatch)
            if isinstance(value, str):
                raise ConfigError(f"trainer.{name} must be an integer"
                                  + (" or auto" if name == "micro_batch_size" else "")
                                  + f" or null, got {short_repr(value)}")
            if value is not None and value < 1:
                raise ConfigError(f"trainer.{name} must be >= 1 or null, got {value}")
        if self.val_every_n_epochs < 0:
            raise ConfigError(
                f"trainer.val_every_n_epochs must be >= 0, got {self.val_every_n_epochs}")
        # Run safety: the seed feeds numpy's generators, which take unsigned 32-bit seeds.
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"trainer.seed must be between 0 and {2**32 - 1}, got {self.seed}")
        if self.max_grad_norm is not None and not 0 < self.max_grad_norm < math.inf:
            raise ConfigError(
                f"trainer.max_grad_norm must be > 0 or null (no clipping), got {self.max_grad_norm}")
        check_resume(self.resume)
        if self.micro_batch_size == "auto" and self.backend.startswith("fsdp"):
            raise ConfigError(
                f"trainer.micro_batch_size auto does not run under trainer.backend "
                f"{self.backend} yet (its out-of-memory retry keeps gradients local with DDP's "
                "no_sync); give a micro_batch_size, or use ddp/ddp-amp to find one")
        if self.micro_batch_size not in (None, "auto") and self.gpu_batch_size_limit is not None:
            raise ConfigError(
                f"trainer.micro_batch_size ({self.micro_batch_size}, exact) and "
                f"trainer.gpu_batch_size_limit ({self.gpu_batch_size_limit}, PyMarlin's "
                "ceiling) are both set; keep one")
        if self.sanity_val_batches < 0:
            raise ConfigError(f"trainer.sanity_val_batches must be >= 0 (0: off), got "
                              f"{self.sanity_val_batches}")
        if self.init_from is not None and not self.init_from.strip():
            raise ConfigError("trainer.init_from is empty; give a checkpoint directory or a "
                              ".safetensors file, or null")
        # TrainerArguments(checkpoint={...}) from Python: each section from its dict.
        for name, cls in (("checkpoint", CheckpointArguments), ("fsdp", FSDPArguments),
                          ("dp", DPArguments), ("early_stopping", EarlyStoppingArguments),
                          ("ema", EmaArguments), ("distributed", DistArguments)):
            if isinstance(getattr(self, name), dict):
                setattr(self, name, build_dataclass(cls, getattr(self, name),
                                                    prefix=f"trainer.{name}."))
        if self.peak_tflops is not None and not 0 < self.peak_tflops < math.inf:
            raise ConfigError(f"trainer.peak_tflops must be > 0 (dense TFLOP/s of one device) "
                              f"or null, got {self.peak_tflops}")
        if (self.early_stopping.enabled and not self.val_every_n_epochs
                and not self.val_every_n_steps):
            raise ConfigError("trainer.early_stopping needs validation: set "
                              "trainer.val_every_n_steps or trainer.val_every_n_epochs")
        self._check_dp()
        hints = get_type_hints(type(self))
        for name in ("amp_dtype", "compile_mode", "on_nonfinite",
                     "resume_config"):  # also when built in Python
            allowed = get_args(hints[name])
            if getattr(self, name) not in allowed:
                value = str(getattr(self, name))
                raise ConfigError(f"trainer.{name} is {short_repr(value)}"
                                  f"{suggest(value, allowed)}; "
                                  f"expected one of: {', '.join(allowed)}")
        for i, name in enumerate(self.writers):
            if name not in WRITERS:
                raise ConfigError(
                    f"trainer.writers[{i}] is '{name}'{suggest(name, WRITERS)}; "
                    f"available writers: {', '.join(WRITERS)}")
        if len(set(self.writers)) != len(self.writers):
            raise ConfigError(f"trainer.writers lists a writer twice: {self.writers}")
        if not 0 < self.progress_interval < math.inf:
            raise ConfigError(
                f"trainer.progress_interval must be > 0 seconds, got {self.progress_interval}")
        steps = self.profile_steps
        if steps is not None and (len(steps) != 2 or not 1 <= steps[0] <= steps[1]):
            raise ConfigError(
                f"trainer.profile_steps must be [start, end] with 1 <= start <= end "
                f"(optimizer steps, counted from 1), got {steps}")

    def _check_dp(self) -> None:
        """trainer.dp against the backend and the settings DP-SGD cannot honour."""
        self.dp.check_for(self.backend)
        if not is_private(self.backend):
            return
        clashes = {"max_grad_norm": (self.max_grad_norm is not None,
                                     "clipping is per sample: use trainer.dp.max_grad_norm"),
                   "micro_batch_size": (self.micro_batch_size == "auto",
                                        "Poisson steps vary in size: give a micro_batch_size"),
                   "compile": (self.compile, "Opacus's per-sample gradient hooks run eagerly"),
                   "activation_checkpointing": (bool(self.activation_checkpointing),
                                                "recomputed forwards would capture "
                                                "per-sample activations twice")}
        for key, (bad, why) in clashes.items():
            if bad:
                raise ConfigError(f"trainer.{key} does not combine with trainer.backend "
                                  f"{self.backend}: {why}")
