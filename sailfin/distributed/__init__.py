"""Rank discovery and collectives.

``DistEnv`` (and torch with it) is imported when first touched, so that the light
modules here (exit codes, launch notes) load without torch: the sailfin command
handles SIGTERM and Ctrl-C before it imports torch."""

from __future__ import annotations

from typing import Any

__all__ = ["DistEnv"]


def __getattr__(name: str) -> Any:
    if name == "DistEnv":
        from .env import DistEnv

        globals()[name] = DistEnv
        return DistEnv
    raise AttributeError(f"module 'sailfin.distributed' has no attribute '{name}'")
