"""Where this process sits in a job: rank, world size, local rank.

A :class:`DistEnv` is passed to whatever needs to know; there is no global.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional


@dataclass(frozen=True)
class DistEnv:
    """Rank and world of this process.

    Example::

        env = DistEnv.from_environ()      # reads torchrun's RANK, WORLD_SIZE, ...
        if env.is_main:
            print("writing logs")
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launcher: str = "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_environ(cls, environ: Optional[Mapping[str, str]] = None) -> "DistEnv":
        """Read torchrun's variables; a process without them is rank 0 of 1."""
        env = os.environ if environ is None else environ
        if "RANK" in env and "WORLD_SIZE" in env:
            return cls(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                       local_rank=int(env.get("LOCAL_RANK", 0)),
                       local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
                       launcher="torchrun")
        return cls()
