"""Backends: a strategy (where a step runs) composed with a precision.

PyMarlin's backend names are aliases for compositions.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..config.errors import ConfigError, suggest
from ..config.trainer import TrainerArguments
from ..distributed import DistEnv
from .precision import Precision
from .strategy import SingleDevice

# name -> (strategy, precision)
ALIASES: dict[str, tuple[str, str]] = {
    "sp": ("single", "fp32"),
}

_PRECISIONS: dict[str, Callable[[TrainerArguments, torch.device], Precision]] = {
    "fp32": lambda args, device: Precision(),
}
_STRATEGIES: dict[str, Callable[..., SingleDevice]] = {
    "single": SingleDevice,
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
    return device


def build_backend(args: TrainerArguments, dist: DistEnv) -> SingleDevice:
    """Resolve ``args.backend`` into a strategy holding a precision."""
    if args.backend not in ALIASES:
        raise ConfigError(f"trainer.backend '{args.backend}'{suggest(args.backend, ALIASES)} "
                          f"is not known; valid backends: {', '.join(ALIASES)}")
    strategy, precision = ALIASES[args.backend]
    device = resolve_device(args.device, dist)
    return _STRATEGIES[strategy](_PRECISIONS[precision](args, device), device, dist)


__all__ = ["ALIASES", "Precision", "SingleDevice", "build_backend", "resolve_device"]
