"""The plugin's user errors, and importing its optional dependencies."""

from __future__ import annotations

import importlib
from types import ModuleType

from ..config import ConfigError


class HFConfigError(ConfigError):
    """Bad input to a ``sailfin.hf`` piece (a file, a column, a label count, a length):
    the CLI prints its one line and exits 2, before the first step."""


def require(name: str) -> ModuleType:
    """Import ``name`` (``transformers``, ``tokenizers``, ``datasets``), or say which extra
    installs it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise HFConfigError(f"sailfin.hf needs the '{name}' package: pip install "
                            f"'sailfin[hf]'" + (" datasets" if name == "datasets" else "")
                            ) from None
