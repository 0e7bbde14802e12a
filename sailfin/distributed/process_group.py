"""Joining and leaving the process group, with a timeout on every wait."""

from __future__ import annotations

import datetime
import os
import shlex
import sys
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from .elastic import torchrun_store
from .env import DistEnv, DistEnvError


def comm_backend_for(device: torch.device, requested: str = "auto") -> str:
    """NCCL for CUDA devices, gloo for CPU; a request that cannot work is an error."""
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise DistEnvError(f"trainer.distributed.comm_backend is 'nccl' but the device is "
                           f"{device}; NCCL needs CUDA: use comm_backend gloo or auto")
    return requested


def init_process_group(env: DistEnv, device: torch.device, comm_backend: str = "auto",
                       timeout_seconds: float = 1800.0,
                       environ: Optional[Mapping[str, str]] = None) -> bool:
    """Join the job's process group; return True if this call created it.

    An existing group (the user called ``init_process_group`` already) is used as
    it is, after checking that it matches ``env``.
    """
    if dist.is_initialized():
        if dist.get_rank() != env.rank or dist.get_world_size() != env.world_size:
            raise DistEnvError(
                f"a process group already exists as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the launcher says rank {env.rank} of "
                f"{env.world_size}; let sailfin create the group or make them agree")
        return False
    environ = os.environ if environ is None else environ
    backend = comm_backend_for(device, comm_backend)
    timeout = datetime.timedelta(seconds=timeout_seconds)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if env.launcher == "torchrun" and "TORCHELASTIC_RUN_ID" in environ:
        # A fresh key namespace per restart attempt (see elastic.py).
        store = torchrun_store(environ, env.rank, env.world_size, timeout)
    else:
        if env.master_addr is None or env.master_port is None:
            raise DistEnvError(
                f"rank {env.rank} of {env.world_size} ({env.launcher}) does not know where "
                "rank 0 listens: set MASTER_ADDR and MASTER_PORT (or "
                "trainer.distributed.master_addr / master_port) to rank 0's host and a "
                "free port")
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                              is_master=env.rank == 0, timeout=timeout,
                              wait_for_workers=False)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size,
                            timeout=timeout, **kwargs)
    return True


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def launch_hint(nproc: Optional[int] = None) -> str:
    """The torchrun command that would start this program as a DDP job."""
    if nproc is None:
        nproc = torch.cuda.device_count() if torch.cuda.is_available() else 2
    argv = list(sys.argv)
    prog = os.path.basename(argv[0]) if argv else ""
    if prog in ("sailfin", "__main__.py") or argv[:1] == ["-m"]:
        command = ["-m", "sailfin", *argv[1:]]
    elif argv and argv[0] not in ("", "-c"):
        command = argv
    else:
        command = ["-m", "sailfin", "train", "CONFIG.yaml"]
    if "--trainer.backend" not in " ".join(command) and "--trainer.backend=" not in " ".join(
            command):
        command += ["--trainer.backend", "ddp"]
    return shlex.join(["torchrun", f"--nproc-per-node={nproc}", *command])
