"""Rank discovery and collectives."""

from .env import DistEnv

__all__ = ["DistEnv"]
