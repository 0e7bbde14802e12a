"""Where this process sits in a job (:class:`DistEnv`), the process group and its
collectives, and the hang watchdog. Nothing imported here imports torch."""

from .env import DistEnv

__all__ = ["DistEnv"]
