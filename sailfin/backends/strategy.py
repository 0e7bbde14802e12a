"""Strategy: where a step runs and how gradients are combined. The trainer owns the loop
and calls these methods; a strategy never loops.

``trainer.compile`` compiles the step runner (:class:`StepRunner`), in place and before
a strategy wraps it: compiling the model's ``forward`` alone would miss the loss and
anything else ``train_step`` does (docs/backends.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Optional

import torch

from ..distributed import DistEnv
from ..utils.voice import say
from .checkpointing import apply_activation_checkpointing
from .precision import _NULL, Precision
from .state import optimizer_state_is_named


@dataclass(frozen=True)
class Execution:
    """How a step's graph runs, whatever the strategy and precision.

    Example::

        Execution(compile=True, activation_checkpointing=("Block",))
    """

    compile: bool = False
    compile_mode: str = "default"
    activation_checkpointing: tuple[str, ...] = ()
    sync_batchnorm: bool = False
    threads: Optional[int] = None  # CPU intra-op threads per process (trainer.threads)


class StepRunner(torch.nn.Module):
    """Runs the recipe's ``train_step`` through ``nn.Module.__call__``, so that wrappers
    that work in ``forward`` (DDP prepares its gradient all-reduce there) see the step.
    Its only child is the recipe: its parameters are the recipe's own."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, global_step: int, batch: Any, device: torch.device) -> Any:
        return self.module.train_step(global_step, batch, device)


class CompileError(RuntimeError):
    """torch.compile could not compile the recipe's step; the message says why."""


def compile_in_place(runner: torch.nn.Module, mode: str) -> None:
    runner.compile(mode=None if mode == "default" else mode)


def explain_failures(run: Callable[..., Any], recipe: str) -> Callable[..., Any]:
    """``run`` with compiler errors re-raised as :class:`CompileError` naming the way out."""
    from ..compat.torch import compiler_error

    TorchDynamoException = compiler_error()

    def guarded(*args: Any) -> Any:
        try:
            return run(*args)
        except TorchDynamoException as exc:
            reason = str(exc).strip().split("\n\n")[0]
            raise CompileError(
                f"torch.compile could not compile {recipe}.train_step: "
                f"{type(exc).__name__}: {reason}\n"
                "Run it eagerly with trainer.compile: false (--trainer.compile false); if the "
                "error remains without compilation, it is in the recipe.") from exc

    return guarded


class SingleDevice:
    """One process, one device. Holds a :class:`Precision` and forwards to it.

    Example::

        backend = SingleDevice(Precision(), torch.device("cpu"))
        backend.setup(module)
        out = backend.train_step(module, step, batch, sync=True)
    """

    strategy = "single"

    def __init__(self, precision: Precision, device: torch.device,
                 dist: Optional[DistEnv] = None, execution: Optional[Execution] = None) -> None:
        self.precision = precision
        self.device = device
        self.dist = dist or DistEnv()
        self.execution = execution or Execution()
        self.checkpointed: list[str] = []  # submodules whose activations are recomputed

    @property
    def name(self) -> str:
        return f"{self.strategy}+{self.precision.name}"

    # -- set-up -------------------------------------------------------------
    def setup(self, module: torch.nn.Module) -> None:
        """Place the module and build ``self.runner``, which runs one ``train_step``: a
        :class:`StepRunner` around the recipe, which :meth:`wrap` may put inside a
        wrapper that must see the step through ``forward`` (DDP); None: the recipe is
        called directly. Checkpointing comes first (compilation and wrappers see the
        checkpointed forwards), then compilation, then :meth:`wrap`."""
        ex = self.execution
        self.set_threads()
        if ex.sync_batchnorm:
            self.convert_batchnorm(module)
        self.place(module)
        self._val_step = module.val_step
        if ex.activation_checkpointing:
            self.checkpointed = apply_activation_checkpointing(module, ex.activation_checkpointing)
        self._train_step = module.train_step
        runner = StepRunner(module)
        if ex.compile:
            self.compile_runner(runner)
        self.runner = self._run = self.wrap(runner)
        if ex.compile:
            if self.runner is None:
                self.runner = runner
            self._run = explain_failures(self.runner, type(module).__name__)

    def place(self, module: torch.nn.Module) -> None:
        module.to(self.device)

    threads_note: Optional[str] = None  # sp's choice of CPU threads, for the trainer to say

    def set_threads(self) -> None:
        """On CPU, the process's intra-op threads, said once: oversubscribed threads on a
        busy machine cost more than they give (docs/performance.md)."""
        if self.device.type != "cpu":
            return
        threads, source = self.thread_choice()
        torch.set_num_threads(threads)
        if self.strategy == "single":  # said as training starts (Trainer.train), so that
            # an error before step 1 stays one line
            self.threads_note = f"SP on CPU: {threads} intra-op thread(s) ({source})"
        elif self.dist.is_main:
            say(f"{self.strategy.upper()} on CPU: {threads} intra-op thread(s) per process "
                f"({source})")

    def thread_choice(self) -> tuple[int, str]:
        """``trainer.threads``, else ``OMP_NUM_THREADS`` (as torch read it), else torch's
        own count, but no more than the CPUs this process may run on."""
        if self.execution.threads is not None:
            return self.execution.threads, "trainer.threads"
        if "OMP_NUM_THREADS" in os.environ:
            return torch.get_num_threads(), f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
        cpus = usable_cpus()
        return (max(1, min(torch.get_num_threads(), cpus)),
                f"{cpus} usable CPU(s); trainer.threads or OMP_NUM_THREADS sets it")

    def convert_batchnorm(self, module: torch.nn.Module) -> None:
        if self.dist.is_main:
            say("trainer.distributed.sync_batchnorm: true changes nothing on a single "
                "process (sp): its BatchNorm statistics are the whole batch's already",
                warning=True)

    def sync_buffers(self, module: torch.nn.Module) -> None:
        """Make every rank's buffers (BatchNorm statistics) rank 0's, before validation:
        one process has nothing to do."""

    def compile_runner(self, runner: StepRunner) -> None:
        compile_in_place(runner, self.execution.compile_mode)

    def batch_plan(self, plan: Any) -> Any:
        """The batch plan this backend trains with (dp: a plan of its own)."""
        return plan

    def attach_optimizers(self, optimizers: list[torch.optim.Optimizer], num_samples: int,
                          steps_per_epoch: int) -> None:
        """Called once the recipe built its optimizers (dp wraps them)."""

    def wrap(self, runner: StepRunner) -> Optional[torch.nn.Module]:
        """Wrap the step runner for this strategy; None: call the recipe directly."""
        return None

    def sync_context(self, sync: bool) -> ContextManager:
        """Context for a micro-batch's forward; ``sync=False`` keeps gradients local."""
        return _NULL

    def teardown(self) -> None:
        pass

    # -- one step -------------------------------------------------------------
    def train_step(self, module: torch.nn.Module, global_step: int, batch: Any,
                   sync: bool = True) -> Any:
        with self.precision.forward_context():
            if self.runner is None:
                return self._train_step(global_step, batch, self.device)
            with self.sync_context(sync):
                return self._run(global_step, batch, self.device)

    def val_step(self, module: torch.nn.Module, global_step: int, batch: Any) -> Any:
        with self.precision.forward_context():
            return self._val_step(global_step, batch, self.device)

    def predict_step(self, module: torch.nn.Module, global_step: int, batch: Any) -> Any:
        """The recipe's ``predict_step`` (``sailfin predict``), run as :meth:`val_step` is."""
        with self.precision.forward_context():
            return module.predict_step(global_step, batch, self.device)

    def validation_outputs(self, module: torch.nn.Module, global_step: int,
                           batches: Iterable[Any]) -> list[Any]:
        return [self.val_step(module, global_step, batch) for batch in batches]

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.backward(loss)

    def clip_grad_norm(self, parameters: Iterable[torch.nn.Parameter],
                       optimizers: list[torch.optim.Optimizer], max_norm: float
                       ) -> torch.Tensor:
        for opt in optimizers:
            self.precision.unscale_gradients(opt)  # clip true gradients, not scaled ones
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def optimizer_step(self, optimizers: list[torch.optim.Optimizer]) -> bool:
        """Step every optimizer; False when the precision skipped the step."""
        stepped = all([self.precision.optimizer_step(opt) for opt in optimizers])  # each steps
        self.precision.update()
        return stepped

    # -- collectives (trivial on one process) ------------------------------------
    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather_outputs(self, outputs: dict[str, Any]) -> dict[str, Any]:
        """Every rank's merged validation outputs, in dataset order (one rank: its own)."""
        return outputs

    def barrier(self) -> None:
        pass

    def gather_scalars(self, values: torch.Tensor) -> torch.Tensor:
        """Every rank's 1-d ``values`` stacked in rank order: shape (world, len(values))."""
        return values.detach().reshape(1, -1)

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks (one small all-reduce when distributed)."""
        return value

    def local_gradients(self) -> ContextManager:
        """Backward keeps gradients on this rank; :meth:`reduce_gradients` combines them
        later (``micro_batch_size: auto``'s probes: a rank out of memory must not leave
        its partners in a gradient all-reduce)."""
        return _NULL

    def reduce_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Average gradients kept local by :meth:`local_gradients` over the ranks."""

    def group_store(self) -> Optional[Any]:
        """The process group's key-value store (the hang watchdog's); None on one process."""
        return None

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank (one rank: ``obj`` itself)."""
        return obj

    # -- model and optimizer state (the fsdp strategy keeps them sharded) ----------
    def model_state_dict(self, module: torch.nn.Module) -> dict[str, Any]:
        return module.state_dict()

    def load_model_state_dict(self, module: torch.nn.Module, state: dict[str, Any]) -> None:
        module.load_state_dict(state)

    def optimizer_state_dict(self, module: torch.nn.Module,
                             optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, module: torch.nn.Module,
                                  optimizer: torch.optim.Optimizer,
                                  state: dict[str, Any]) -> None:
        """``state`` by parameter index (``state_dict()``) or by name (a sharded checkpoint)."""
        if optimizer_state_is_named(state):
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
            set_optimizer_state_dict(module, optimizer, state)
        else:
            optimizer.load_state_dict(state)

    def final_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full weights under the plain model's names. Every rank calls it (a
        collective under fsdp); rank 0 saves what it returns."""
        return module.state_dict()

    def save_final_weights(self, module: torch.nn.Module, path: str, write: bool
                           ) -> Optional[str]:
        """The full weights as safetensors at ``path``, under the plain model's names,
        tied weights once (under their first name). Every rank calls it (a collective
        under fsdp); the rank with ``write`` writes the file and gets its path."""
        from .weights_file import save_weights

        return save_weights(self.final_state_dict(module), path) if write else None

    # -- checkpoint state -------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"precision": self.precision.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.precision.load_state_dict(state.get("precision", {}))


def _step_plain(optimizers: list[torch.optim.Optimizer]) -> bool:
    for opt in optimizers:
        opt.step()
    return True


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: taskset, a container's cpuset)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


class PlainSingleDevice(SingleDevice):
    """:class:`SingleDevice` in float32, uncompiled (``sp``): nothing happens around a
    step, so its step methods are the recipe's ``train_step``, ``Tensor.backward`` and the
    optimizers' ``step`` themselves, one Python call fewer each per micro-batch.

    Example::

        backend = PlainSingleDevice(Precision(), torch.device("cpu"))
        backend.setup(module)
        backend.backward(backend.train_step(module, 0, batch))
    """

    def __init__(self, precision: Precision, device: torch.device,
                 dist: Optional[DistEnv] = None, execution: Optional[Execution] = None) -> None:
        if type(precision) is not Precision or (execution is not None and execution.compile):
            raise ValueError("PlainSingleDevice runs float32 steps uncompiled; use "
                             "SingleDevice for mixed precision or compile")
        super().__init__(precision, device, dist, execution)

    backward = staticmethod(torch.Tensor.backward)  # fp32: nothing to scale
    optimizer_step = staticmethod(_step_plain)      # fp32: nothing to unscale or skip

    def train_step(self, module: torch.nn.Module, global_step: int, batch: Any,
                   sync: bool = True) -> Any:
        return self._train_step(global_step, batch, self.device)  # no autocast to enter
