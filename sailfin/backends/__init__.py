"""Backends: a strategy (where a step runs) composed with a precision.

PyMarlin's backend names are aliases for compositions.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..config.dp import DP_SUFFIX, is_private
from ..config.errors import ConfigError, suggest
from ..config.trainer import BACKEND_ALIASES, BACKENDS, PRIVATE_BACKENDS, TrainerArguments
from ..distributed import DistEnv
from ..utils.voice import say
from .amp import MixedPrecision
from .precision import Precision
from .strategy import Execution, PlainSingleDevice, SingleDevice

# name -> (strategy, precision), and the "-dp" names (PyMarlin's sp-dp and ddp-dp, and
# fsdp-dp; the -amp-dp ones are refused with the reason when built): one list, in the
# config's schema (sailfin train --help prints it).
ALIASES = BACKEND_ALIASES
PRIVATE = PRIVATE_BACKENDS

# Names kept for PyMarlin configs whose meaning changed: printed once when chosen.
NOTICES: dict[str, str] = {
    "sp-amp-apex": "trainer.backend sp-amp-apex runs PyTorch's native AMP "
                   "(Apex is not used); it is the same as sp-amp",
}

_PRECISIONS: dict[str, Callable[[TrainerArguments, torch.device], Precision]] = {
    "fp32": lambda args, device: Precision(),
    "amp": lambda args, device: MixedPrecision(args.amp_dtype, device),  # bf16 or fp16
}


# Each strategy's factory takes ``compose``: the class it builds goes through it first
# (dp: a subclass with DP-SGD's step methods; otherwise the class itself).
Compose = Callable[[type], type]


def _single(precision: Precision, device: torch.device, dist: DistEnv,
            args: TrainerArguments, execution: Execution, compose: Compose) -> SingleDevice:
    if dist.is_distributed:
        raise ConfigError(
            f"trainer.backend '{args.backend}' trains in one process, but this is rank "
            f"{dist.rank} of {dist.world_size} ({dist.launcher}): every rank would train alone. "
            "Use trainer.backend ddp (or ddp-amp) under a launcher, or leave trainer.backend "
            "out: its default, auto, is ddp here")
    plain = type(precision) is Precision and not execution.compile  # fp32, called directly
    return compose(PlainSingleDevice if plain else SingleDevice)(
        precision, device, dist, execution)


def _ddp(precision: Precision, device: torch.device, dist: DistEnv,
         args: TrainerArguments, execution: Execution, compose: Compose) -> SingleDevice:
    from .ddp import DDPStrategy  # imports torch.distributed pieces only when used

    return compose(DDPStrategy)(precision, device, dist, args.distributed, execution)


def _fsdp(precision: Precision, device: torch.device, dist: DistEnv,
          args: TrainerArguments, execution: Execution, compose: Compose) -> SingleDevice:
    from .fsdp import FSDPStrategy  # imports torch.distributed pieces only when used

    return compose(FSDPStrategy)(precision, device, dist, args.distributed, execution,
                                 args.fsdp)


_STRATEGIES: dict[str, Callable[[Precision, torch.device, DistEnv, TrainerArguments,
                                 Execution, Compose], SingleDevice]] = {
    "single": _single,
    "ddp": _ddp,
    "fsdp": _fsdp,
}


def resolve_device(spec: str, dist: DistEnv) -> torch.device:
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", dist.local_rank % torch.cuda.device_count())
        return torch.device("cpu")
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
    if args.backend in NOTICES and dist.is_main:
        say(NOTICES[args.backend])
    device = resolve_device(args.device, dist)
    execution = Execution(args.compile, args.compile_mode, tuple(args.activation_checkpointing),
                          args.distributed.sync_batchnorm)
    if args.distributed.sync_batchnorm and strategy != "single" and device.type == "cpu":
        raise ConfigError(
            f"trainer.distributed.sync_batchnorm: true needs a CUDA device: PyTorch's SyncBatchNorm does "
            f"not train on CPU (trainer.backend {args.backend} here). Remove it: on CPU each "
            "rank's BatchNorm statistics are made rank 0's before every validation, the "
            "statistics that are saved")
    chosen = _PRECISIONS[precision](args, device)
    if not private:
        return _STRATEGIES[strategy](chosen, device, dist, args, execution, _same)
    from .dp import check_private, private_class  # imports Opacus only when used

    check_private(strategy, chosen, args)
    backend = _STRATEGIES[strategy](chosen, device, dist, args, execution, private_class)
    backend.init_privacy(args)
    return backend


def _same(cls: type) -> type:
    return cls


__all__ = ["ALIASES", "Execution", "MixedPrecision", "PlainSingleDevice", "Precision",
           "SingleDevice", "build_backend", "resolve_device"]
