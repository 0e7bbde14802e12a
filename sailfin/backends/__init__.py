"""Backends: a strategy (where a step runs) composed with a precision.

PyMarlin's backend names are aliases for compositions.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config.dp import DP_SUFFIX, is_private
from ..config.errors import ConfigError, suggest
# ALIASES: name -> (strategy, precision), the one list, in the config's schema.
from ..config.trainer import BACKEND_ALIASES as ALIASES, BACKENDS, TrainerArguments
from ..distributed import DistEnv
from ..utils.voice import say
from .precision import MixedPrecision, Precision
from .strategy import Execution, PlainSingleDevice, SingleDevice

def resolve_device(spec: str, dist: DistEnv) -> torch.device:
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ConfigError(f"trainer.device {spec!r} is not a device; use auto, cpu, cuda "
                          "or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"trainer.device is {spec!r} but CUDA is not available here; "
                          "use trainer.device auto or cpu")
    if device.type == "cuda" and device.index is None:
        # One device per local process: rank r of a node takes GPU r.
        device = torch.device("cuda", dist.local_rank % torch.cuda.device_count())
    return device


def build_backend(args: TrainerArguments, dist: DistEnv) -> SingleDevice:
    """Resolve ``args.backend`` into a strategy holding a precision (``auto`` first into
    ``ddp`` or ``sp``, written back to ``args``: the name in effect is the one saved)."""
    if args.backend == "auto":  # what HF Trainer, Accelerate and Lightning do under torchrun
        args.backend = "ddp" if dist.is_distributed else "sp"
        if dist.is_distributed and dist.is_main:
            say(f"trainer.backend auto -> ddp ({dist.world_size} processes from "
                f"{dist.launcher})")
    private = is_private(args.backend)  # "<name>-dp": DP-SGD composed on <name>
    name = args.backend[:-len(DP_SUFFIX)] if private else args.backend
    if name not in ALIASES:
        known = ["auto", *BACKENDS]
        raise ConfigError(f"trainer.backend '{args.backend}'{suggest(args.backend, known)} "
                          f"is not known; valid backends: {', '.join(known)}")
    strategy, precision = ALIASES[name]
    if precision == "fp32" and args.amp_dtype != "auto":
        amp = [name for name, (_, p) in ALIASES.items() if p == "amp"]
        raise ConfigError(f"trainer.amp_dtype is {args.amp_dtype} but trainer.backend "
                          f"{args.backend} runs in float32; use a mixed-precision backend "
                          f"({', '.join(amp)}) or remove amp_dtype")
    if args.backend == "sp-amp-apex" and dist.is_main:  # a PyMarlin name whose meaning changed
        say("trainer.backend sp-amp-apex runs PyTorch's native AMP (Apex is not used); it is "
            "the same as sp-amp")
    device = resolve_device(args.device, dist)
    execution = Execution(args.compile, args.compile_mode, tuple(args.activation_checkpointing),
                          args.distributed.sync_batchnorm, args.threads)
    if args.distributed.sync_batchnorm and strategy != "single" and device.type == "cpu":
        raise ConfigError(
            "trainer.distributed.sync_batchnorm: true needs a CUDA device: PyTorch's "
            f"SyncBatchNorm does not train on CPU (trainer.backend {args.backend} here). Remove "
            "it: on CPU each rank's BatchNorm statistics are made rank 0's before every "
            "validation, the statistics that are saved")
    chosen = MixedPrecision(args.amp_dtype, device) if precision == "amp" else Precision()
    if private:
        from .dp import check_private, private_class  # imports Opacus only when used

        check_private(strategy, chosen, args)
    if strategy == "single" and dist.is_distributed:
        raise ConfigError(
            f"trainer.backend '{args.backend}' trains in one process, but this is rank "
            f"{dist.rank} of {dist.world_size} ({dist.launcher}): every rank would train alone. "
            "Use trainer.backend ddp (or ddp-amp) under a launcher, or leave trainer.backend "
            "out: its default, auto, is ddp here")
    options: dict[str, Any] = {"options": args.distributed}
    if strategy == "ddp":  # torch.distributed's pieces are imported only when used
        from .ddp import DDPStrategy as cls
    elif strategy == "fsdp":
        from .fsdp import FSDPStrategy as cls
        options["fsdp"] = args.fsdp
    else:  # fp32 uncompiled: the recipe's step is called directly
        plain = type(chosen) is Precision and not execution.compile
        cls, options = PlainSingleDevice if plain else SingleDevice, {}
    backend = (private_class(cls) if private else cls)(chosen, device, dist,
                                                        execution=execution, **options)
    if private:
        backend.init_privacy(args)
    return backend


__all__ = ["ALIASES", "Execution", "MixedPrecision", "PlainSingleDevice", "Precision",
           "SingleDevice", "build_backend", "resolve_device"]
