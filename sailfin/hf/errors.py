"""The plugin's user errors, and importing its optional dependencies."""

from __future__ import annotations

import importlib
from types import ModuleType

from ..config import ConfigError


class HFConfigError(ConfigError):
    """Bad input to a ``sailfin.hf`` piece (a file, a column, a label count, a length):
    the CLI prints its one line and exits 2, before the first step."""


# The extra that installs each optional package sailfin.hf imports when a feature is used.
EXTRAS = {"transformers": "hf", "tokenizers": "hf", "peft": "peft", "pyarrow": "parquet"}


def require(name: str) -> ModuleType:
    """Import ``name`` (``transformers``, ``tokenizers``, ``peft``, ``pyarrow``,
    ``datasets``), or say which extra installs it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        extra = EXTRAS.get(name.split(".")[0])
        how = f"pip install 'sailfin[{extra}]'" if extra else f"pip install {name}"
        raise HFConfigError(f"sailfin.hf needs the '{name}' package: {how}") from None
