"""Builds the optional pieces of the loop from the config: EMA weights, validation
every N steps, early stopping, the FLOPs meter; then what watches the run: writers and
the progress display (rank 0 only), the profiler."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional

from ...config.dp import is_private
from ...config.trainer import TrainerArguments
from ...distributed import DistEnv
from ...logging.writers import Writer, Writers, build_writers
from ..core.callbacks import Callback
from .early_stopping import EarlyStopping
from .ema import WeightAverage
from .flops import FirstStepFlops, FlopsMeter, build_flops_meter
from .privacy import PrivacyCallback
from .profiler import StepProfiler
from .progress import Progress
from .speed_checks import Bf16CpuCheck, CompileCheck

if TYPE_CHECKING:
    from ..core.view import RunView


class StepValidation(Callback):
    """``trainer.val_every_n_steps``: calls ``trainer.validate()`` after steps N, 2N, ...
    (a function of the global step, so a resumed run validates where the uninterrupted
    one would have). The time spent validating is not training time: it leaves
    ``train_seconds`` and the throughput of the next train log line."""

    def __init__(self, every: int) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = every

    def on_step_end(self, trainer: "RunView") -> None:
        if trainer.global_step % self.every:
            return
        started = time.perf_counter()
        trainer.validate()
        trainer.exclude_time(time.perf_counter() - started)


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
    if precision == "bf16" and backend.device.type == "cpu":  # sp-amp: is bf16 emulated?
        callbacks.append(Bf16CpuCheck())
    counting = [FirstStepFlops(flops)] if flops.pending else []
    return LoopFeatures(ema, flops, callbacks, counting)


@dataclass
class Observers:
    writers: Writers
    callbacks: list[Callback]


def build_observers(args: TrainerArguments, dist: DistEnv,
                    writers: Optional[Iterable[Writer]] = None,
                    hparams: Optional[Mapping[str, Any]] = None,
                    callbacks: Iterable[Callback] = ()) -> Observers:
    """Writers (``writers`` if given, else ``args.writers``; they check their destinations
    here, before the first step), progress and profiler; ranks but 0 get no writers and
    no progress. ``hparams`` (default: the trainer settings) are logged once, flattened."""
    made: list[Callback] = []
    progress: Optional[Progress] = None
    built = Writers()
    if dist.is_main:
        if args.progress != "none":
            progress = Progress(args.progress, interval=args.progress_interval)
        if writers is not None:
            built = Writers(writers)
        else:
            built = build_writers(
                args.writers, args.output_dir,
                stdout=progress.console if progress is not None else None,
                mlflow_tracking_uri=args.mlflow_tracking_uri,
                mlflow_experiment=args.mlflow_experiment)
        try:
            built.log_hparams(flatten(hparams if hparams is not None
                                      else {"trainer": dataclasses.asdict(args)}))
        except BaseException:
            built.close()
            raise
        # A callback that is a writer too (a Progress given) sees the logged values.
        built.writers.extend(c for c in callbacks if isinstance(c, Writer))
        if progress is not None:
            built.writers.append(progress)
            made.append(progress)
    if args.profile_steps is not None:
        start, end = args.profile_steps
        made.append(StepProfiler(
            start, end, os.path.join(args.output_dir, "profile"), rank=dist.rank,
            stream=progress.console() if progress is not None else None))
    if args.compile and args.compile_check:  # is compiling paying? measured once, in the log
        made.append(CompileCheck())
    return Observers(built, made)


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"trainer": {"epochs": 3}}`` -> ``{"trainer.epochs": 3}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
