"""The process group: joining it (with a timeout on every wait), leaving it, and the
collectives the trainer needs (a mean, and validation outputs gathered in order).
Under torchrun each restart attempt gets its own key namespace (why: docs/elastic.md).
"""

from __future__ import annotations

import datetime
import os
import shlex
import sys
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from .env import DistEnv, DistEnvError


def attempt_prefix(environ: Mapping[str, str]) -> str:
    """The key namespace of this rendezvous round of this torchrun job. torchrun counts
    restarts after failures but not the rounds a joining node starts; within one restart
    count the world only grows, so (restart count, world size) names every round once."""
    run_id = environ.get("TORCHELASTIC_RUN_ID", "none")
    restart = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    world = environ.get("WORLD_SIZE", "0")
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "False":
        # Rank 0 hosts a fresh store every round (no stale keys), and the restart count
        # differs between nodes: an agent whose own workers did not fail does not count
        # the round its partner's failure started. One name for all of them.
        return f"sailfin/{run_id}/port-{environ.get('MASTER_PORT', '0')}-world-{world}"
    return f"sailfin/{run_id}/attempt-{restart}-world-{world}"


def torchrun_store(environ: Mapping[str, str], rank: int, world_size: int,
                   timeout: datetime.timedelta) -> dist.Store:
    """A store for ``init_process_group(store=...)`` under torchrun: when the agent shares
    its store (the default), every rank is a client; otherwise rank 0 hosts it."""
    try:
        host, port = environ["MASTER_ADDR"], int(environ["MASTER_PORT"])
    except (KeyError, ValueError):
        raise RuntimeError("torchrun did not set MASTER_ADDR/MASTER_PORT; start the job with "
                           "torchrun, or set trainer.distributed for another launcher") from None
    agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world_size, is_master=not agent_store and rank == 0,
                          timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore(attempt_prefix(environ), store)


def comm_backend_for(device: torch.device, requested: str = "auto") -> str:
    """NCCL for CUDA devices, gloo for CPU; a request that cannot work is an error."""
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise DistEnvError(f"trainer.distributed.comm_backend is 'nccl' but the device is "
                           f"{device}; NCCL needs CUDA: use comm_backend gloo or auto")
    return requested


def init_process_group(env: DistEnv, device: torch.device, comm_backend: str,
                       timeout_seconds: float) -> bool:
    """Join the job's process group (``comm_backend`` from :func:`comm_backend_for`);
    return True if this call created it. An existing group (the user called
    ``init_process_group`` already) is used as it is, after checking that it matches."""
    if dist.is_initialized():
        if dist.get_rank() != env.rank or dist.get_world_size() != env.world_size:
            raise DistEnvError(
                f"a process group already exists as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the launcher says rank {env.rank} of "
                f"{env.world_size}; let sailfin create the group or make them agree")
        return False
    timeout = datetime.timedelta(seconds=timeout_seconds)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if env.launcher == "torchrun" and "TORCHELASTIC_RUN_ID" in os.environ:
        # A fresh key namespace per restart attempt (see the module docstring).
        store = torchrun_store(os.environ, env.rank, env.world_size, timeout)
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
    dist.init_process_group(comm_backend, store=store, rank=env.rank, world_size=env.world_size,
                            timeout=timeout, **kwargs)
    return True


def launch_hint() -> str:
    """The torchrun command that would start this program as a DDP job."""
    nproc = torch.cuda.device_count() if torch.cuda.is_available() else 2
    argv = list(sys.argv)
    prog = os.path.basename(argv[0]) if argv else ""
    if prog in ("sailfin", "__main__.py") or argv[:1] == ["-m"]:
        command = ["-m", "sailfin", *argv[1:]]
    elif argv and argv[0] not in ("", "-c"):
        command = argv
    else:
        command = ["-m", "sailfin", "train", "CONFIG.yaml"]
    if "--trainer.backend" not in " ".join(command):
        command += ["--trainer.backend", "ddp"]
    return shlex.join(["torchrun", f"--nproc-per-node={nproc}", *command])


def gather_outputs(local: dict[str, Any], rank: int, world_size: int,
                   device: torch.device) -> dict[str, Any]:
    """Every rank's merged validation outputs, concatenated in rank order: each rank
    validates a contiguous share of the dataset, so rank order is dataset order. Tensors
    take one all-gather per key (padded to the longest share, trimmed after), other
    values ``all_gather_object``. Every rank gets the same result."""
    descriptions: list[Any] = [None] * world_size
    dist.all_gather_object(descriptions, _describe(local))
    out: dict[str, Any] = {}
    for key in _agreed_keys(descriptions):
        if {d[key][0] for d in descriptions if d} == {"tensor"}:
            out[key] = _gather_tensor(local.get(key), key, descriptions, rank, device)
        else:
            parts: list[Any] = [None] * world_size
            value = local.get(key, [])
            dist.all_gather_object(parts, value.cpu() if isinstance(value, torch.Tensor)
                                   else value)
            out[key] = _chain(parts)
    return out


def _describe(local: dict[str, Any]) -> dict[str, tuple]:
    return {key: ("tensor", tuple(v.shape), str(v.dtype).replace("torch.", ""))
            if isinstance(v, torch.Tensor) and v.dim() > 0 else ("object", type(v).__name__)
            for key, v in local.items()}


def _agreed_keys(descriptions: list[Any]) -> list[str]:
    shares = [(r, d) for r, d in enumerate(descriptions) if d]  # not the empty shares
    for r, d in shares[1:]:
        if set(d) != set(shares[0][1]):
            raise ValueError(
                f"val_step returned keys {sorted(d)} on rank {r} but {sorted(shares[0][1])} "
                f"on rank {shares[0][0]}; return the same keys on every rank and batch")
    return list(shares[0][1]) if shares else []


def _gather_tensor(value: Optional[torch.Tensor], key: str, descriptions: list[Any],
                   rank: int, device: torch.device) -> torch.Tensor:
    shapes = [d[key][1] if d else None for d in descriptions]
    dtypes = {d[key][2] for d in descriptions if d}
    trailing = {s[1:] for s in shapes if s is not None}
    if len(dtypes) > 1 or len(trailing) > 1:
        raise ValueError(
            f"val_step output '{key}' has different dtypes or trailing shapes across ranks "
            f"({sorted(dtypes)}, {sorted(trailing)}); return the same shape after the batch "
            "dimension on every rank")
    dtype = getattr(torch, dtypes.pop())
    tail = trailing.pop()
    lengths = [s[0] if s is not None else 0 for s in shapes]
    # Gloo has no bool all-gather: move bools as bytes.
    wire = torch.uint8 if dtype is torch.bool else dtype
    padded = torch.zeros((max(lengths), *tail), dtype=wire, device=device)
    if value is not None and lengths[rank]:
        padded[:lengths[rank]] = value.detach().to(device=device, dtype=wire)
    parts = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(parts, padded)
    result = torch.cat([p[:n] for p, n in zip(parts, lengths)])
    return result.to(dtype) if wire is not dtype else result


def _chain(parts: list[Any]) -> Any:
    values = [p for p in parts if p is not None]
    if values and all(isinstance(p, torch.Tensor) for p in values):
        return torch.cat([p.reshape(-1) if p.dim() == 0 else p for p in values])
    chained: list[Any] = []
    for p in values:
        chained.extend(p if isinstance(p, list) else [p])
    return chained
