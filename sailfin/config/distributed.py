"""The ``trainer.distributed:`` section: how this process finds its job."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional, Union

from .errors import ConfigError, short_repr

Launcher = Literal["auto", "torchrun", "slurm", "mpi", "manual", "none"]


@dataclass
class DistArguments:
    """Rank discovery and process-group settings. ``launcher: auto`` reads torchrun's,
    SLURM's or an MPI launcher's variables; ``manual`` takes ``rank``, ``world_size``,
    ``master_addr`` and ``master_port`` from here.

    Example::

        trainer:
          backend: ddp
          distributed: {launcher: manual, rank: 0, world_size: 2,
                        master_addr: 10.0.0.1, master_port: 29500}
    """

    launcher: Launcher = "auto"
    """auto (torchrun, SLURM, MPI variables) or manual (the keys below)."""
    rank: Optional[int] = None
    """This process's rank (launcher: manual)."""
    world_size: Optional[int] = None
    """Number of processes (launcher: manual)."""
    local_rank: Optional[int] = None
    """Rank on this node: picks the GPU (launcher: manual)."""
    local_world_size: Optional[int] = None
    """Processes on this node (launcher: manual)."""
    master_addr: Optional[str] = None
    """Address of rank 0 for the rendezvous (launcher: manual)."""
    master_port: Optional[int] = None
    """Port of rank 0 for the rendezvous (launcher: manual)."""
    comm_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group back end: auto is NCCL on CUDA, gloo on CPU."""
    timeout_seconds: float = 1800.0
    """How long a collective or the rendezvous may wait before failing."""
    find_unused_parameters: bool = False
    """DDP: allow parameters that get no gradient in a step (costs a graph walk)."""
    sync_buffers: bool = True
    """Copy rank 0's buffers (BatchNorm statistics) to every rank before each step's forward."""
    sync_batchnorm: bool = False
    """ddp/fsdp: convert BatchNorm layers to torch.nn.SyncBatchNorm (statistics over the
    whole global batch, every rank the same; needs a CUDA device). Without it, each rank's
    BatchNorm buffers are made equal to rank 0's before every validation (what is saved)."""
    threads_per_process: Optional[int] = None
    """CPU intra-op threads per process (null: OMP_NUM_THREADS, else cores / local processes)."""
    # -- hang watchdog (sailfin.distributed.watchdog) --
    hang_seconds: Union[float, Literal["auto"], None] = "auto"
    """A rank that makes no progress for this long ends the job with a report naming it
    (stacks of every rank, then a non-zero exit torchrun can restart). ``auto``: 300 s in a
    job of several processes, off in a single process; null: off."""
    hang_seconds_slow_phases: Union[float, Literal["auto"], None] = "auto"
    """The same limit while every rank is in a phase known to be slow: set-up and resume,
    the start-up checks, a checkpoint save, validation (with ``on_end_val_epoch``), the
    end-of-step and end-of-epoch callbacks (a frozen rank is named after hang_seconds).
    ``auto``: 4 x hang_seconds; null: hang_seconds; never less than hang_seconds."""

    def __post_init__(self) -> None:
        if self.launcher == "manual":
            missing = [k for k in ("rank", "world_size", "master_addr", "master_port")
                       if getattr(self, k) is None]
            if missing:
                raise ConfigError(
                    "trainer.distributed.launcher is 'manual' but "
                    f"{', '.join('trainer.distributed.' + k for k in missing)} "
                    f"{'is' if len(missing) == 1 else 'are'} not set; set them, or use "
                    "launcher auto under torchrun, SLURM or MPI")
        for name, least in (("world_size", 1), ("local_world_size", 1),
                            ("threads_per_process", 1), ("rank", 0), ("local_rank", 0)):
            value = getattr(self, name)
            if value is not None and value < least:
                raise ConfigError(f"trainer.distributed.{name} must be >= {least}, got {value}")
        if (self.rank is not None and self.world_size is not None
                and self.rank >= self.world_size):
            raise ConfigError(f"trainer.distributed.rank={self.rank} must be below "
                              f"world_size={self.world_size}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError(
                f"trainer.distributed.master_port must be a TCP port (1-65535), got "
                f"{self.master_port}")
        hang = self.hang_seconds
        if hang is not None and hang != "auto" and (isinstance(hang, str) or not 0 < hang < math.inf):
            raise ConfigError(f"trainer.distributed.hang_seconds must be > 0 seconds, auto "
                              f"or null (off), got {short_repr(hang)}")
        slow = self.hang_seconds_slow_phases
        if slow is not None and slow != "auto" and (isinstance(slow, str) or not 0 < slow):
            raise ConfigError(f"trainer.distributed.hang_seconds_slow_phases must be > 0 "
                              f"seconds, auto or null (= hang_seconds), got {short_repr(slow)}")
        if not 0 < self.timeout_seconds < math.inf:
            raise ConfigError(f"trainer.distributed.timeout_seconds must be > 0, got "
                              f"{self.timeout_seconds}")
