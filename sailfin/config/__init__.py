"""Typed config: dataclass schema, YAML and command-line loading. No torch here."""

from .checkpoint import CheckpointArguments
from .distributed import DistArguments
from .errors import ConfigError
from .loop import EarlyStoppingArguments, EmaArguments
from .loader import ComponentSpec, RunConfig, from_dict, load_config
from .trainer import TrainerArguments

__all__ = ["CheckpointArguments", "ConfigError", "ComponentSpec", "DistArguments",
           "EarlyStoppingArguments", "EmaArguments",
           "RunConfig", "TrainerArguments", "from_dict", "load_config"]
