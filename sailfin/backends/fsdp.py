"""The FSDP strategy: parameters, gradients and optimizer state sharded over the ranks
with PyTorch's FSDP2 (``fully_shard``; docs/sharding.md). It is the DDP strategy's
sibling under the process-group base (:mod:`.parallel`): units instead of
``DistributedDataParallel``, a group of one when started alone, and state dicts that
stay sharded (:mod:`sailfin.checkpoint.dcp_io`). The starting weights come from
:mod:`.fsdp_build`, the choice of units from :mod:`.fsdp_units`.
"""

from __future__ import annotations

import datetime
from typing import Any, ContextManager, Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,
                                    OffloadPolicy, fully_shard)
from torch.distributed.tensor import DTensor

from .weights_file import SafetensorsWriter, TensorSpec, file_order
from ..compat.fsdp import settle_roots
from ..config.distributed import DistArguments
from ..config.errors import ConfigError
from ..config.fsdp import FSDPArguments
from ..distributed import DistEnv
from ..utils.memory import fix_mmap_threshold, release_free_memory
from ..utils.voice import say
from .fsdp_build import (Start, buffers_to, capture_start, check_same_model,
                         init_on_shards, receive_from_rank0, require_init_weights)
from .fsdp_units import checked, select_units
from .parallel import ParallelStrategy
from .precision import Precision
from .state import dcp_optimizer_state, named_optimizer_state, optimizer_state_is_named
from .strategy import _NULL, Execution, StepRunner, compile_in_place

_END = object()


class FSDPStrategy(ParallelStrategy):
    """Fully sharded data parallel over ``dist.world_size`` processes (FSDP2).

    Under a launcher it joins the job's group; started alone it trains as a
    group of one (the same code path, nothing sharded), so a run can move
    between one process and many by changing only the launch command.

    Example (every process runs this; torchrun starts them)::

        backend = FSDPStrategy(Precision(), torch.device("cpu"), DistEnv.from_environ(),
                               fsdp=FSDPArguments(units=["Block"]))
        backend.setup(module)        # module's parameters are now DTensor shards
    """

    strategy = "fsdp"
    needs_launcher = False

    def __init__(self, precision: Precision, device: torch.device,
                 dist_env: Optional[DistEnv] = None,
                 options: Optional[DistArguments] = None,
                 execution: Optional[Execution] = None,
                 fsdp: Optional[FSDPArguments] = None) -> None:
        super().__init__(precision, device, dist_env, options, execution)
        self.fsdp = fsdp or FSDPArguments()
        if self.fsdp.cpu_offload and device.type != "cuda":
            raise ConfigError("trainer.fsdp.cpu_offload moves shards off the accelerator, but "
                              f"this run trains on {device}: its shards are in CPU memory "
                              "already; set trainer.fsdp.cpu_offload false")
        self.units: list[str] = []  # dotted names of the submodules sharded as units
        self.root: Optional[FSDPModule] = None
        self._start: Start = ({}, {})  # rank 0's model until shards are filled

    # -- set-up ----------------------------------------------------------------------
    def join_group(self) -> bool:
        if self.dist.launched or dist.is_initialized():
            return super().join_group()
        # Started alone: a group of one, in memory, so fully_shard has a mesh.
        dist.init_process_group(self.comm_backend, store=dist.HashStore(), rank=0,
                                world_size=1,
                                timeout=datetime.timedelta(seconds=self.options.timeout_seconds))
        return True

    def shard_options(self) -> dict[str, Any]:
        """The keyword arguments every ``fully_shard`` call of this run gets."""
        param_dtype = getattr(self.precision, "dtype", None)
        return {
            "reshard_after_forward": self.fsdp.reshard_after_forward,
            # Compute copies in the autocast type; gradients reduced (and kept) in fp32.
            "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype,
                                              reduce_dtype=torch.float32 if param_dtype
                                              else None),
            "offload_policy": CPUOffloadPolicy() if self.fsdp.cpu_offload else OffloadPolicy(),
        }

    def shard(self, module: torch.nn.Module) -> torch.nn.Module:
        """Make ``module`` an FSDP unit with this run's options; returns it. With
        ``trainer.compile`` the unit is compiled first, then sharded (FSDP2's order: the
        compiled forward sees local parameters, the unit's hooks gather around it)."""
        if self.execution.compile:
            compile_in_place(module, self.execution.compile_mode)
        return fully_shard(module, **self.shard_options())

    def place(self, module: torch.nn.Module) -> None:
        if self.device.type == "cpu" or self.fsdp.cpu_offload:
            # Gathered units (host memory) go back to the system when freed, not into
            # heaps that count as resident: before the first unit is materialised.
            fix_mmap_threshold()
        # Nothing moves yet: the model is sharded first, then each rank fills its rows
        # (wrap). Every rank must have built the model rank 0 built.
        check_same_model(module, self.dist.rank, self.broadcast_object)
        if self.fsdp.build == "meta":
            require_init_weights(module)
        else:
            self._start = capture_start(module, self.dist.rank)

    def compile_runner(self, runner: StepRunner) -> None:
        pass  # each unit is compiled as it is sharded (shard()); the root runs eagerly

    def wrap(self, runner: StepRunner) -> torch.nn.Module:
        from ..interfaces import ModuleInterface

        recipe = runner.module
        own = getattr(type(recipe), "configure_sharding", None)
        if callable(own) and own is not ModuleInterface.configure_sharding:
            if self.fsdp.units is not None:
                raise ConfigError(
                    f"{type(recipe).__name__} shards itself in configure_sharding(), and "
                    f"trainer.fsdp.units is {self.fsdp.units} as well; remove one of them")
            recipe.configure_sharding(checked(
                recipe, f"{type(recipe).__name__}.configure_sharding()", self.shard))
            self.units = [name for name, sub in recipe.named_modules()
                          if isinstance(sub, FSDPModule)]
        else:
            for name, sub in select_units(recipe, self.fsdp.units):
                self.shard(sub)
                self.units.append(name)
        # The root: every parameter no unit took. It is the step runner, whose forward
        # runs train_step, so that its hooks (gather before, reduce after) see the step.
        self.root = fully_shard(runner, **self.shard_options())  # type: ignore[assignment]
        # Now that each parameter is a shard: fill this rank's rows. cpu_offload keeps
        # the shards in CPU memory (FSDP2 moves them per unit).
        home = torch.device("cpu") if self.fsdp.cpu_offload else self.device
        if self.fsdp.build == "meta":
            init_on_shards(recipe, home, self.broadcast_object)
        else:
            receive_from_rank0(recipe, self._start, self.dist.rank, home,
                               self._collective_device(), every_rank_empty=self.fsdp.cpu_offload)
        if home != self.device:
            buffers_to(recipe, self.device)
        # FSDP2 names its root at the first forward through it. Validation (the start-up
        # sanity batch runs before any training step) calls the units directly, so each
        # would make itself a root: settle the roles now.
        settle_roots(self.root)
        if self.dist.is_main:
            say(f"FSDP over {self.dist.world_size} rank(s), built by {self.fsdp.build}: units "
                f"{', '.join(self.units) or '(none)'}, then the root")
            if self.dist.world_size == 1 and not self.fsdp.cpu_offload:
                say("fsdp in one process shards nothing, yet every step pays FSDP's gathers "
                    "and gradient reductions (GPT-2 small on one H200: 0.77x sp-amp's tokens/s;"
                    " docs/performance.md): trainer.backend sp or sp-amp runs the same "
                    "training faster; on one device fsdp is for trainer.fsdp.cpu_offload")
        return runner

    def sync_context(self, sync: bool) -> ContextManager:
        # A micro-batch but a step's last keeps its unsharded gradient and skips the
        # reduce-scatter; the last one's backward reduce-scatters the sum once. The flag
        # is read during backward, after this context closed, so it stays set.
        # trainer.fsdp.accumulate sharded: reduce-scatter every micro-batch instead, so
        # that only gradient shards are ever held (less memory, one collective more).
        self.root.set_requires_gradient_sync(  # type: ignore[union-attr]
            sync or self.fsdp.accumulate == "sharded")
        return _NULL

    def val_step(self, module: torch.nn.Module, global_step: int, batch: Any) -> Any:
        # val_step does not go through the root's forward: gather the root's own
        # parameters around it (units gather theirs in their own forwards).
        self.root.unshard()  # type: ignore[union-attr]
        try:
            return super().val_step(module, global_step, batch)
        finally:
            self.root.reshard()  # type: ignore[union-attr]

    def predict_step(self, module: torch.nn.Module, global_step: int, batch: Any) -> Any:
        self.root.unshard()  # as val_step: the root's own parameters gathered around it
        try:
            return super().predict_step(module, global_step, batch)
        finally:
            self.root.reshard()  # type: ignore[union-attr]

    def validation_outputs(self, module: torch.nn.Module, global_step: int,
                           batches: Iterable[Any]) -> list[Any]:
        """Every forward all-gathers, so every rank runs as many as the rank with the most
        batches: a rank out of batches repeats its last one and drops the outputs (the
        split never counts a sample twice; this keeps it so)."""
        outputs: list[Any] = []
        last, batches = None, iter(batches)
        flag = torch.zeros((), device=self._collective_device())
        while True:
            batch = next(batches, _END)
            flag.fill_(0.0 if batch is _END else 1.0)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if not flag.item():
                return outputs
            if batch is not _END:
                outputs.append(self.val_step(module, global_step, batch))
                last = batch
            elif last is None:
                raise RuntimeError(
                    f"rank {self.dist.rank} has no validation batch while other ranks do; "
                    "under fsdp every validation forward is a collective. Use at least "
                    f"{self.dist.world_size} validation samples (one per rank)")
            else:
                self.val_step(module, global_step, last)  # a padding forward: outputs dropped

    def teardown(self) -> None:
        self.root = None
        super().teardown()

    # -- one step ----------------------------------------------------------------------
    def clip_grad_norm(self, parameters: Iterable[torch.nn.Parameter],
                       optimizers: list[torch.optim.Optimizer], max_norm: float
                       ) -> torch.Tensor:
        # Gradients are DTensor shards: clip_grad_norm_ reduces the shards' norms over the
        # ranks, so every rank clips by the global norm.
        norm = super().clip_grad_norm(list(parameters), optimizers, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    # -- state ------------------------------------------------------------------------
    def model_state_dict(self, module: torch.nn.Module) -> dict[str, Any]:
        """Plain parameter names, DTensor shard values: each rank holds its own rows."""
        return get_model_state_dict(module)

    def load_model_state_dict(self, module: torch.nn.Module, state: dict[str, Any]) -> None:
        # Shards (from a sharded checkpoint) go in place; full tensors (an sp or ddp
        # checkpoint) are cut into this rank's rows.
        full = not any(isinstance(v, DTensor) for v in state.values())
        set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=full))

    def optimizer_state_dict(self, module: torch.nn.Module,
                             optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return dcp_optimizer_state(module, optimizer, optimizer.state_dict())

    def load_optimizer_state_dict(self, module: torch.nn.Module,
                                  optimizer: torch.optim.Optimizer,
                                  state: dict[str, Any]) -> None:
        named = optimizer_state_is_named(state)
        if not named:  # an sp/ddp checkpoint: state by parameter index, full tensors
            state = named_optimizer_state(module, optimizer, state)
        values = [v for per in state["state"].values() for v in per.values()]
        # Full tensors are cut into this rank's rows; plain SGD has none to cut.
        full = (not named or not any(isinstance(v, DTensor) for v in values)) and any(
            isinstance(v, torch.Tensor) and v.dim() > 0 for v in values)
        set_optimizer_state_dict(module, optimizer, state,
                                 options=StateDictOptions(full_state_dict=full))

    def final_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        # A collective: every rank gathers; rank 0 receives the full tensors (in CPU
        # memory, one tensor at a time), the others an empty dict.
        return get_model_state_dict(
            module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    @torch.no_grad()
    def save_final_weights(self, module: torch.nn.Module, path: str, write: bool
                           ) -> Optional[str]:
        """Every rank walks the state dict in the file's order, gathers one tensor (an
        all-gather) and drops it before the next; the writing rank appends it to the file
        first. No rank ever holds the whole model (:meth:`final_state_dict` would put it
        all in rank 0's memory), and the header is known before any data (a DTensor has
        the global shape and dtype), so the file is written front to back, once.

        A write that fails (a full disk) does not stop the gathers, so the other ranks
        never wait on a rank that left; the error is raised once every tensor went by.
        """
        state = _distinct(module.state_dict(keep_vars=True))  # the same on every rank
        order = file_order([TensorSpec.of(name, value) for name, value in state.items()])
        writer: Optional[SafetensorsWriter] = None
        error: Optional[BaseException] = None
        if write:
            try:
                writer = SafetensorsWriter(path, order)
            except Exception as exc:  # noqa: BLE001 - raised once the gathers are done
                error = exc
        try:
            for spec in order:
                full = _full(state[spec.name])
                if writer is not None and error is None:
                    try:
                        writer.write(spec.name, full)
                    except Exception as exc:  # noqa: BLE001 - raised once the gathers are done
                        error = exc
                        writer.abort()
                del full  # before the next gather: one full tensor at a time
                release_free_memory()  # gloo's freed buffers, or each gather adds its size
        except BaseException:  # a collective failed: no half-written file stays behind
            if writer is not None:
                writer.abort()
            raise
        if error is not None:
            raise error
        return writer.commit() if writer is not None else None


def _distinct(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor once, under its first name. Tied sharded parameters are one object;
    plain tensors that share memory are tied as safetensors sees them. The choice never
    depends on a rank's shard (an empty one included), so every rank skips the same."""
    seen: set[tuple] = set()
    out = {}
    for name, value in state.items():
        if isinstance(value, DTensor):
            key: Optional[tuple] = ("dtensor", id(value))
        elif value.numel():
            key = (value.untyped_storage().data_ptr(), value.storage_offset(),
                   tuple(value.shape))
        else:
            key = None
        if key is not None and key in seen:
            continue
        seen.add(key)
        out[name] = value
    return out


def _full(value: torch.Tensor) -> torch.Tensor:
    if not isinstance(value, DTensor):
        return value.detach()  # a buffer, the same on every rank
    if value.device.type != value.device_mesh.device_type:
        # cpu_offload: shards in CPU memory, the collective runs on the accelerator.
        value = value.to(value.device_mesh.device_type)
    return value.full_tensor()
