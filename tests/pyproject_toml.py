"""pyproject.toml as a dict, for the tests that check the docs and scripts against it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli, which pytest itself requires there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def project() -> dict[str, Any]:
    """The ``[project]`` table."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
