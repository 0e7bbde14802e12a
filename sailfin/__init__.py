"""sailfin: a lightweight PyTorch training library.

Write a recipe once (a ModuleInterface, a DataInterface, a YAML config) and
run it on a CPU, a GPU, with mixed precision, or over many processes.

``import sailfin`` stays light: torch (and the config schema) is imported when a
name that needs it is first touched (``sailfin.Trainer``), not before.
"""

from __future__ import annotations

import importlib
from typing import Any

from .version import __version__

# Imported when first touched, so that ``python -m sailfin`` reaches its first instruction
# (SIGTERM and Ctrl-C handled: sailfin.signals.stop_at_start) in milliseconds.
_LAZY = {
    "ConfigError": "sailfin.config",
    "RunConfig": "sailfin.config",
    "TrainerArguments": "sailfin.config",
    "load_config": "sailfin.config",
    "Trainer": "sailfin.trainer",
    "Callback": "sailfin.trainer",
    "Checkpointer": "sailfin.checkpoint",
    "DataInterface": "sailfin.interfaces",
    "DataProcessor": "sailfin.interfaces",
    "ModuleInterface": "sailfin.interfaces",
    "DistEnv": "sailfin.distributed",
    "BatchPlan": "sailfin.data",
    "seed_everything": "sailfin.utils.seed",
    "sharded_build": "sailfin.backends.fsdp_build",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sailfin' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted(__all__)
