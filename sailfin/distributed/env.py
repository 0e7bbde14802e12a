"""Where this process sits in a job (:class:`DistEnv`), read from the launcher's
environment variables (torchrun, SLURM, MPI launchers, Azure ML) or given in config
(``trainer.distributed``). It is passed to whatever needs to know; there is no global.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import TYPE_CHECKING, Mapping, Optional

from ..config.errors import ConfigError

if TYPE_CHECKING:
    from ..config.distributed import DistArguments


class DistEnvError(ConfigError):
    """The launcher's variables (or the config) do not describe a valid job."""


@dataclasses.dataclass(frozen=True)
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
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    restart_count: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise DistEnvError(
                f"{self.launcher}: rank {self.rank} is outside world size {self.world_size}; "
                "check the launcher's variables (RANK/WORLD_SIZE or trainer.distributed)")
        if self.local_world_size < 1 or not 0 <= self.local_rank < self.local_world_size:
            raise DistEnvError(
                f"{self.launcher}: local rank {self.local_rank} is outside local world size "
                f"{self.local_world_size} (rank {self.rank})")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def launched(self) -> bool:
        """True when a launcher (or the config) placed this process in a job."""
        return self.launcher != "none"

    # -- discovery -------------------------------------------------------------
    @classmethod
    def from_environ(cls, environ: Optional[Mapping[str, str]] = None) -> "DistEnv":
        """Detect the launcher from the environment; without one, rank 0 of 1."""
        env = os.environ if environ is None else environ
        found = (detect(env) for detect in _DETECTORS.values())
        return next((f for f in found if f is not None), cls())

    @classmethod
    def from_config(cls, args: Optional["DistArguments"],
                    environ: Optional[Mapping[str, str]] = None) -> "DistEnv":
        """Honour ``trainer.distributed``: a named launcher, manual values, or auto."""
        env = os.environ if environ is None else environ
        launcher = args.launcher if args is not None else "auto"
        if launcher == "none":
            return cls()
        if launcher == "manual":
            assert args is not None and args.rank is not None and args.world_size is not None
            return cls(rank=args.rank, world_size=args.world_size,
                       local_rank=args.local_rank or 0,
                       local_world_size=args.local_world_size or 1,  # >= 1 when set
                       launcher="manual", master_addr=args.master_addr,
                       master_port=args.master_port)
        if launcher == "auto":
            found = cls.from_environ(env)
        else:
            found = _DETECTORS[launcher](env)
            if found is None:
                raise DistEnvError(
                    f"trainer.distributed.launcher is '{launcher}' but its variables are "
                    f"not set ({_EXPECTED[launcher]}); start the job with {launcher}, or "
                    "use launcher auto")
        return _apply_overrides(found, args)


_EXPECTED = {
    "torchrun": "RANK, WORLD_SIZE",
    "slurm": "SLURM_PROCID, SLURM_NTASKS",
    "mpi": "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE or PMI_RANK/PMI_SIZE",
}


def _int(env: Mapping[str, str], name: str, default: int = 0) -> int:
    value = env.get(name)
    if value is None:  # a required variable: its caller checked it is there
        return default
    try:
        return int(value)
    except ValueError:
        raise DistEnvError(f"environment variable {name}={value!r} is not an integer") from None


def _port(env: Mapping[str, str]) -> Optional[int]:
    return _int(env, "MASTER_PORT") if "MASTER_PORT" in env else None


def _torchrun(env: Mapping[str, str]) -> Optional[DistEnv]:
    # torchrun (and any env:// launcher) sets RANK and WORLD_SIZE.
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    return DistEnv(rank=_int(env, "RANK"), world_size=_int(env, "WORLD_SIZE"),
                   local_rank=_int(env, "LOCAL_RANK", 0),
                   local_world_size=_int(env, "LOCAL_WORLD_SIZE", 1),
                   launcher="torchrun", master_addr=env.get("MASTER_ADDR"),
                   master_port=_port(env),
                   restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0))


def _slurm(env: Mapping[str, str]) -> Optional[DistEnv]:
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return None
    # An interactive allocation running plain `python` is one task: not a job.
    if env.get("SLURM_JOB_NAME") in ("bash", "interactive") and env.get("SLURM_NTASKS") == "1":
        return None
    local_world = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
    addr = env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST")
                                                or env.get("SLURM_NODELIST") or "")
    port = _port(env)
    if port is None and "SLURM_JOB_ID" in env:
        # Every task of the job derives the same port from the job id.
        port = 15000 + _int(env, "SLURM_JOB_ID") % 20000
    return DistEnv(rank=_int(env, "SLURM_PROCID"), world_size=_int(env, "SLURM_NTASKS"),
                   local_rank=_int(env, "SLURM_LOCALID", 0),
                   local_world_size=int(re.match(r"\d+", local_world).group()),
                   launcher="slurm", master_addr=addr or None, master_port=port,
                   restart_count=_int(env, "SLURM_RESTART_COUNT", 0))


def _mpi(env: Mapping[str, str]) -> Optional[DistEnv]:
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0)
        local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1)
    elif "PMI_RANK" in env and "PMI_SIZE" in env:  # MPICH, Intel MPI
        rank, world = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
        local = _int(env, "MPI_LOCALRANKID", 0)
        local_world = _int(env, "MPI_LOCALNRANKS", 1)
    else:
        return None
    addr, port = env.get("MASTER_ADDR"), _port(env)
    # Azure ML's MPI jobs name the first node in one of these.
    azure = env.get("AZ_BATCH_MASTER_NODE") or env.get("AZ_BATCHAI_MPI_MASTER_NODE")
    if addr is None and azure:
        addr, _, azure_port = azure.partition(":")
        if port is None and azure_port:
            port = int(azure_port)
    return DistEnv(rank=rank, world_size=world, local_rank=local,
                   local_world_size=local_world, launcher="mpi", master_addr=addr,
                   master_port=port)


_DETECTORS = {"torchrun": _torchrun, "slurm": _slurm, "mpi": _mpi}


def _apply_overrides(found: DistEnv, args: Optional["DistArguments"]) -> DistEnv:
    """Config values fill what the launcher left out and must agree with what it set."""
    if args is None:
        return found
    values = {}
    for name in ("rank", "world_size", "local_rank", "local_world_size", "master_addr",
                 "master_port"):
        given = getattr(args, name)
        if given is None:
            continue
        have = getattr(found, name)
        if found.launched and have is not None and have != given:
            raise DistEnvError(
                f"trainer.distributed.{name}={given!r} disagrees with the {found.launcher} "
                f"launcher's value {have!r}; remove it from the config or use launcher manual")
        values[name] = given
    if not found.launched and "world_size" in values:
        values["launcher"] = "manual"
    return dataclasses.replace(found, **values)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[03-05,07],cpu1`` -> ``gpu03``."""
    nodelist = nodelist.strip()
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if match is None:
        return nodelist.split(",")[0]
    prefix, ranges = match.groups()
    return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "")
