"""The DDP strategy: one process per device, gradients averaged by all-reduce.

It is the single-device strategy plus four things: it joins the process group,
wraps the step runner in ``DistributedDataParallel``, skips the gradient
all-reduce on all but the last micro-batch of a step (``no_sync``), and makes
the collectives real.
"""

from __future__ import annotations

import gc
import inspect
import os
from typing import Any, ContextManager, Iterable, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..config.distributed import DistArguments
from ..config.errors import ConfigError
from ..distributed import DistEnv
from ..distributed.collectives import all_reduce_mean, gather_outputs
from ..distributed.process_group import (comm_backend_for, destroy_process_group,
                                         init_process_group, launch_hint)
from ..utils.voice import say
from .precision import Precision
from .strategy import _NULL, Execution, SingleDevice, StepRunner



def _buffer_sync(sync: bool) -> dict[str, bool]:
    """DDP's keyword for syncing buffers before each forward (renamed in newer PyTorch)."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        return {"forward_sync_buffers": sync}
    return {"broadcast_buffers": sync}


class DDPStrategy(SingleDevice):
    """Data parallel over ``dist.world_size`` processes, one device each.

    Example (every process runs this; torchrun starts them)::

        backend = DDPStrategy(Precision(), torch.device("cpu"), DistEnv.from_environ())
        backend.setup(module)        # joins the group; rank 0's weights go everywhere
    """

    strategy = "ddp"
    needs_launcher = True  # FSDP also runs alone, as a group of one

    def __init__(self, precision: Precision, device: torch.device,
                 dist_env: Optional[DistEnv] = None,
                 options: Optional[DistArguments] = None,
                 execution: Optional[Execution] = None) -> None:
        super().__init__(precision, device, dist_env, execution)
        self.options = options or DistArguments()
        if not self.dist.launched and self.needs_launcher:
            raise ConfigError(
                f"trainer.backend '{self.strategy}' runs one process per device, started by a "
                "launcher; "
                f"this process was started alone. Run:\n    {launch_hint()}\n(or set "
                "trainer.distributed for a launcher sailfin does not detect)")
        self.comm_backend = comm_backend_for(device, self.options.comm_backend)
        self._owns_group = False
        self.ddp: Optional[DistributedDataParallel] = None

    # -- set-up ----------------------------------------------------------------------
    def setup(self, module: torch.nn.Module) -> None:
        self._set_threads()
        self._owns_group = init_process_group(self.dist, self.device, self.comm_backend,
                                              self.options.timeout_seconds)
        super().setup(module)

    def wrap(self, runner: StepRunner) -> torch.nn.Module:
        # Construction broadcasts rank 0's parameters and buffers: every rank
        # starts from the same weights whatever its own initialisation was.
        self.ddp = DistributedDataParallel(
            runner, device_ids=[self.device.index] if self.device.type == "cuda" else None,
            find_unused_parameters=self.options.find_unused_parameters,
            **_buffer_sync(self.options.sync_buffers))
        return self.ddp

    def sync_context(self, sync: bool) -> ContextManager:
        # Gradients accumulate locally on every micro-batch but a step's last;
        # the last one's backward all-reduces the accumulated sum once.
        return _NULL if sync else self.ddp.no_sync()

    def _set_threads(self) -> None:
        """One process per core slice: oversubscribed CPU threads cost more than they give."""
        if self.device.type != "cpu":
            return
        threads = self.options.threads_per_process
        source = "trainer.distributed.threads_per_process"
        if threads is None and "OMP_NUM_THREADS" in os.environ:
            if self.dist.is_main:
                say(f"{self.strategy.upper()} on CPU: {torch.get_num_threads()} intra-op "
                    f"thread(s) per process (OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']})")
            return
        if threads is None:
            threads = max(1, (os.cpu_count() or 1) // self.dist.local_world_size)
            source = f"{os.cpu_count()} cores / {self.dist.local_world_size} local processes"
        torch.set_num_threads(threads)
        if self.dist.is_main:
            say(f"{self.strategy.upper()} on CPU: {threads} intra-op thread(s) per process "
                f"({source})")

    def teardown(self) -> None:
        if self._owns_group:
            # DDP holds the process group: drop it first, so that the group is
            # destroyed now, while the interpreter is whole, not during exit.
            self.ddp = self.runner = self._run = None
            destroy_process_group()
            gc.collect()
            self._owns_group = False

    # -- collectives -------------------------------------------------------------------
    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return all_reduce_mean(tensor, self.dist.world_size)

    def gather_outputs(self, outputs: dict[str, Any]) -> dict[str, Any]:
        device = self.device if self.comm_backend == "nccl" else torch.device("cpu")
        return gather_outputs(outputs, self.dist.rank, self.dist.world_size, device)

    def barrier(self) -> None:
        if self.comm_backend == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def gather_scalars(self, values: torch.Tensor) -> torch.Tensor:
        device = self.device if self.comm_backend == "nccl" else torch.device("cpu")
        local = values.detach().reshape(-1).to(device)
        out = torch.empty(self.dist.world_size * local.numel(), dtype=local.dtype,
                          device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, local)  # all_gather_single: the newer name (the old one warns)
        return out.view(self.dist.world_size, -1)

    def agree_min(self, value: int) -> int:
        device = self.device if self.comm_backend == "nccl" else torch.device("cpu")
        flag = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return int(flag.item())

    def local_gradients(self) -> ContextManager:
        return self.ddp.no_sync()

    def reduce_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        # What DDP's reducer does in backward, in one flat all-reduce: the sum over ranks
        # divided by the world size. A parameter without a gradient on this rank adds 0.
        params = list(parameters)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.dist.world_size
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n

    def group_store(self) -> Optional[Any]:
        from ..compat.torch import default_store
        return default_store()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]
