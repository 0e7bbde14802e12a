"""The base of the strategies that run one process per device in a process group: it
joins the group (and leaves it at teardown), sets each process's CPU threads, and makes
the collectives real. Its two children, DDP (:mod:`.ddp`) and FSDP (:mod:`.fsdp`), each
bring their own wrapper.
"""

from __future__ import annotations

import gc
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..config.distributed import DistArguments
from ..config.errors import ConfigError
from ..distributed import DistEnv
from ..distributed.process_group import (comm_backend_for, gather_outputs,
                                         init_process_group, launch_hint)
from .precision import Precision
from .strategy import Execution, SingleDevice


class ParallelStrategy(SingleDevice):
    """One process per device, ``dist.world_size`` of them, in one process group: joined
    in :meth:`setup` before the module is placed, left in :meth:`teardown` if this
    created it. A child supplies :meth:`wrap`.

    Example (every process runs this; torchrun starts them)::

        backend = DDPStrategy(Precision(), torch.device("cpu"), DistEnv.from_environ())
        backend.setup(module)        # joins the group; rank 0's weights go everywhere
        backend.all_reduce_mean(loss)
    """

    needs_launcher = True  # whether a process started alone is refused

    def __init__(self, precision: Precision, device: torch.device,
                 dist_env: Optional[DistEnv] = None,
                 options: Optional[DistArguments] = None,
                 execution: Optional[Execution] = None) -> None:
        super().__init__(precision, device, dist_env, execution)
        self.options = options or DistArguments()
        if not self.dist.launched and self.needs_launcher:
            raise ConfigError(
                f"trainer.backend '{self.strategy}' runs one process per device, started by a "
                f"launcher; this process was started alone. Run:\n    {launch_hint()}\n(or "
                "set trainer.distributed for a launcher sailfin does not detect)")
        self.comm_backend = comm_backend_for(device, self.options.comm_backend)
        self._owns_group = False

    # -- set-up ----------------------------------------------------------------------
    def setup(self, module: torch.nn.Module) -> None:
        self._owns_group = self.join_group()
        super().setup(module)  # sets the threads first

    def join_group(self) -> bool:
        """Join the launcher's process group; True if this call created it."""
        return init_process_group(self.dist, self.device, self.comm_backend,
                                  self.options.timeout_seconds)

    def thread_choice(self) -> tuple[int, str]:
        """One process per core slice: ``trainer.threads``, else
        ``trainer.distributed.threads_per_process``, else ``OMP_NUM_THREADS``, else the
        cores shared by the processes on this node."""
        threads = self.execution.threads
        if threads is not None:
            return threads, "trainer.threads"
        threads = self.options.threads_per_process
        if threads is not None:
            return threads, "trainer.distributed.threads_per_process"
        if "OMP_NUM_THREADS" in os.environ:  # as torch set them
            return torch.get_num_threads(), f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
        return (max(1, (os.cpu_count() or 1) // self.dist.local_world_size),
                f"{os.cpu_count()} cores / {self.dist.local_world_size} local processes")

    def convert_batchnorm(self, module: torch.nn.Module) -> None:
        # In place (the recipe, a ModuleInterface, is never a BatchNorm itself): the same
        # parameters and buffers, before the module is placed and wrapped.
        torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)

    def sync_buffers(self, module: torch.nn.Module) -> None:
        # Each rank's forwards updated its own running statistics; validation and the
        # saved model must use the same ones: rank 0's, as DDP's broadcast_buffers does
        # (ddp and fsdp alike: fsdp does not shard buffers).
        for buffer in module.buffers():
            dist.broadcast(buffer.data, src=0)

    def teardown(self) -> None:
        if self._owns_group:
            # The wrapper holds the process group: drop it first (a child drops its own
            # references before calling this), so that the group is destroyed now, while
            # the interpreter is whole, not during exit.
            self.runner = self._run = None
            if dist.is_initialized():
                dist.destroy_process_group()
            gc.collect()
            self._owns_group = False

    # -- collectives -------------------------------------------------------------------
    def _collective_device(self) -> torch.device:
        return self.device if self.comm_backend == "nccl" else torch.device("cpu")

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.detach().clone()  # a new tensor: the input is untouched
        dist.all_reduce(out)
        return out / self.dist.world_size

    def gather_outputs(self, outputs: dict[str, Any]) -> dict[str, Any]:
        return gather_outputs(outputs, self.dist.rank, self.dist.world_size,
                              self._collective_device())

    def barrier(self) -> None:
        dist.barrier(device_ids=[self.device.index] if self.comm_backend == "nccl" else None)

    def gather_scalars(self, values: torch.Tensor) -> torch.Tensor:
        device = self._collective_device()
        local = values.detach().reshape(-1).to(device)
        out = torch.empty(self.dist.world_size * local.numel(), dtype=local.dtype,
                          device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, local)  # all_gather_single: the newer name (the old one warns)
        return out.view(self.dist.world_size, -1)

    def agree_min(self, value: int) -> int:
        flag = torch.tensor([value], dtype=torch.int64, device=self._collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return int(flag.item())

    def group_store(self) -> Optional[Any]:
        from ..compat.torch import default_store
        return default_store()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]
