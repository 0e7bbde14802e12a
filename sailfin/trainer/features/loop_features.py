"""Builds the optional pieces of the loop from the config: EMA weights, validation
every N steps, early stopping, and the FLOPs meter; and their part of summary.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from ...config.dp import is_private
from ...config.trainer import TrainerArguments
from ...distributed import DistEnv
from ..core.callbacks import Callback
from .bf16_check import bf16_cpu_check
from .early_stopping import EarlyStopping
from .ema import WeightAverage
from .flops import FlopsMeter, build_flops_meter
from .flops_count import FirstStepFlops
from .privacy import PrivacyCallback
from .step_validation import StepValidation

if TYPE_CHECKING:
    from ..core.view import RunView


@dataclass
class LoopFeatures:
    ema: Optional[WeightAverage]
    flops: FlopsMeter
    callbacks: list[Callback] = field(default_factory=list)
    # Last in the step hooks: a step auto micro-batch runs again is counted afresh.
    last_callbacks: list[Callback] = field(default_factory=list)


def build_loop_features(module: Any, args: TrainerArguments, backend: Any,
                        dist: DistEnv) -> LoopFeatures:
    """After the backend placed (and wrapped) the module, before resume. Callback order
    matters: the average is updated before a step validation that may use it, and
    validation comes before early stopping looks at its result."""
    callbacks: list[Callback] = []
    ema = None
    if args.ema.enabled:
        ema = WeightAverage(module, args.ema)  # from the initial weights, on their device
        callbacks.append(ema)
    if args.val_every_n_steps:
        callbacks.append(StepValidation(args.val_every_n_steps))
    if args.early_stopping.enabled:
        callbacks.append(EarlyStopping(args.early_stopping))
    if is_private(args.backend):  # epsilon in the metrics and summary, max_epsilon
        callbacks.append(PrivacyCallback(args.dp, args.log_every_n_steps))
    # What the backend runs: a backend built in Python may compile whatever args say.
    precision = getattr(getattr(backend, "precision", None), "name", "fp32")
    compiled = bool(getattr(getattr(backend, "execution", None), "compile", args.compile))
    flops = build_flops_meter(module, args, dist.world_size, backend.device, precision,
                              compiled=compiled)
    check = bf16_cpu_check(backend)  # sp-amp on a CPU that emulates bf16: warn at start
    if check is not None:
        callbacks.append(check)
    counting = [FirstStepFlops(flops)] if flops.pending else []
    return LoopFeatures(ema, flops, callbacks, counting)


def finish_summary(trainer: "RunView") -> dict[str, Any]:
    """summary.json's fields for these features: why the run stopped early, FLOPs, EMA."""
    out: dict[str, Any] = {"stopped_early": trainer.stop_reason}
    meter = trainer.flops
    if meter.flops_per_sample is not None:
        rate = (trainer.samples_seen / trainer.train_seconds
                if trainer.train_seconds > 0 else None)
        out["flops_per_sample"] = meter.flops_per_sample
        out.update(meter.metrics(rate) if rate else {})
    if trainer.ema is not None:
        out["ema"] = {"decay": trainer.ema.decay, "updates": trainer.ema.updates,
                      "validated_with_ema": trainer.args.ema.validate}
    return out
