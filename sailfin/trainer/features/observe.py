"""Builds what watches a run from the config: writers and the progress display
(rank 0 only) and the profiler."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

from ...config.trainer import TrainerArguments
from ...distributed import DistEnv
from ...logging.writers import Writer, Writers, build_writers
from ..core.callbacks import Callback
from .compile_check import CompileCheck
from .profiler import StepProfiler
from .progress import Progress


@dataclass
class Observers:
    writers: Writers
    callbacks: list[Callback]


def build_observers(args: TrainerArguments, dist: DistEnv,
                    writers: Optional[Iterable[Writer]] = None,
                    hparams: Optional[Mapping[str, Any]] = None,
                    callbacks: Iterable[Callback] = ()) -> Observers:
    """Writers (``writers`` if given, else ``args.writers``), progress and profiler.

    Ranks other than 0 get no writers and no progress display. Writers check
    their destinations here, before the first step. ``hparams`` (default: the
    trainer settings) are logged once, flattened to dotted keys. A callback
    that is also a :class:`Writer` (a :class:`Progress` passed in ``callbacks``)
    receives the logged values too.
    """
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
        # The progress display shows the values the trainer logs: it is a writer too.
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
