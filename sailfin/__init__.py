"""sailfin: a lightweight PyTorch training library.

Write a recipe once (a ModuleInterface, a DataInterface, a YAML config) and
run it on a CPU, a GPU, with mixed precision, or over many processes.

``import sailfin`` stays light: torch is imported when a torch-using name is
first touched (``sailfin.Trainer``), not before.
"""

from __future__ import annotations

import importlib
from typing import Any

from .config import ConfigError, RunConfig, TrainerArguments, load_config
from .version import __version__

_LAZY = {
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

__all__ = ["ConfigError", "RunConfig", "TrainerArguments", "load_config", "__version__",
           *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sailfin' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted(__all__)
