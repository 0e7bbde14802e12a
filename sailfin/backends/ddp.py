"""The DDP strategy: the process-group strategy (:mod:`.parallel`) with the step runner
in ``DistributedDataParallel``, whose gradient all-reduce is skipped on all but the
last micro-batch of a step (``no_sync``)."""

from __future__ import annotations

import inspect
from typing import ContextManager, Iterable, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .parallel import ParallelStrategy
from .strategy import _NULL, StepRunner


class DDPStrategy(ParallelStrategy):
    """Data parallel over ``dist.world_size`` processes, one device each.

    Example (every process runs this; torchrun starts them)::

        backend = DDPStrategy(Precision(), torch.device("cpu"), DistEnv.from_environ())
        backend.setup(module)        # joins the group; rank 0's weights go everywhere
    """

    strategy = "ddp"
    ddp: Optional[DistributedDataParallel] = None

    def wrap(self, runner: StepRunner) -> torch.nn.Module:
        # Construction broadcasts rank 0's parameters and buffers: every rank
        # starts from the same weights whatever its own initialisation was. Syncing
        # buffers before each forward is forward_sync_buffers in newer PyTorch.
        renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        self.ddp = DistributedDataParallel(
            runner, device_ids=[self.device.index] if self.device.type == "cuda" else None,
            find_unused_parameters=self.options.find_unused_parameters,
            **{"forward_sync_buffers" if renamed else "broadcast_buffers":
               self.options.sync_buffers})
        return self.ddp

    def sync_context(self, sync: bool) -> ContextManager:
        # Gradients accumulate locally on every micro-batch but a step's last;
        # the last one's backward all-reduces the accumulated sum once.
        return _NULL if sync else self.ddp.no_sync()

    def teardown(self) -> None:
        if self._owns_group:
            self.ddp = None  # it holds the process group
        super().teardown()

    # -- micro_batch_size auto's probing steps ------------------------------------------
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
        for p, g in zip(params, flat.split([g.numel() for g in grads])):
            p.grad = g.view_as(p).clone()
