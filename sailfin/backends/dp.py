"""Differential privacy (DP-SGD on Opacus) composed on a strategy: ``sp-dp``, ``ddp-dp``,
``fsdp-dp`` (:func:`private_class`: a subclass of the strategy's class). docs/dp.md says
which Opacus pieces each runs, how a step clips and noises, and what a checkpoint keeps
so that a resumed run adds the same noise and reports the same epsilon.
"""

from __future__ import annotations

import math
import secrets
import warnings
from functools import lru_cache
from itertools import chain
from typing import Any, Optional

import numpy as np
import torch

from ..config.errors import ConfigError
from ..config.trainer import TrainerArguments
from ..data.plan import BatchPlan
from ..data.poisson import PoissonPlan, PrivatePlan
from ..compat.opacus import drop_pending_step
from .precision import Precision
from .privacy_budget import Segment, epsilon_of, new_accountant, plan_segment
from .privacy_model import attach_hooks, check_model, import_opacus, naming_inplace_outputs
from .strategy import _NULL, SingleDevice, StepRunner


def check_private(strategy: str, precision: Precision, args: TrainerArguments) -> None:
    """Refuse, before anything is built, the compositions DP-SGD cannot run."""
    if strategy == "fsdp" and args.dp.clipping != "ghost":
        raise ConfigError(
            f"trainer.backend {args.backend}: Opacus trains FSDP-sharded models with ghost "
            f"clipping only (its ghost_fsdp mode), not trainer.dp.clipping "
            f"{args.dp.clipping}; set trainer.dp.clipping: ghost (train_step returns the "
            "per-sample losses), or train with ddp-dp")
    if type(precision) is not Precision:
        raise ConfigError(
            f"trainer.backend {args.backend}: mixed precision does not combine with dp "
            "(per-sample gradients and their norms are computed in float32); use "
            f"{strategy.replace('single', 'sp')}-dp")
    import_opacus()


@lru_cache(maxsize=None)
def private_class(strategy: type) -> type:
    """``strategy`` with DP-SGD composed on it: a subclass whose step methods come from
    :class:`PrivateStrategy` (built once per strategy class)."""
    return type(f"Private{strategy.__name__}", (PrivateStrategy, strategy),
                {"__doc__": f"{strategy.__name__} with DP-SGD (see sailfin.backends.dp).",
                 "__module__": __name__})


class PrivateStrategy(SingleDevice):
    """The DP-SGD pieces of a step, placed before a strategy class in the MRO.

    Example::

        backend = private_class(SingleDevice)(Precision(), torch.device("cpu"))
        backend.init_privacy(TrainerArguments(backend="sp-dp", dp={"noise_multiplier": 1.0}))
        backend.setup(module)                                # checks, hooks
        backend.attach_optimizers([opt], num_samples=1000, steps_per_epoch=16)
        backend.begin_segment(steps=16)                      # the noise, the epsilon table
        backend.epsilon()                                    # 0.0 before the first step
    """

    def init_privacy(self, args: TrainerArguments) -> None:
        self.dp_args, self.train_args = args.dp, args
        self.hooks: Any = None
        self.dp_optimizer: Any = None
        self.accountant: Any = None
        self.noise_rng: Optional[torch.Generator] = None
        self.noise_multiplier = args.dp.noise_multiplier
        self.sample_rate = 0.0
        self.delta = 0.0
        self.planned_steps = 0
        self.accounted = 0              # steps the accountant holds (every checkpoint's too)
        self.segment: Optional[Segment] = None  # this run's noise and epsilon table
        self._segment_start = 0         # self.accounted when the segment began
        self._seed = args.seed          # the Poisson draws' and the noise's seed
        self._open_step = -1            # the global step whose micro-batches run now
        self._last_micro = True
        self._forwarded = False         # the run's first forward is checked (in-place ops)
        self._ghost_loss: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    @property
    def name(self) -> str:
        return f"{super().name}+dp"

    # -- set-up -----------------------------------------------------------------------
    def setup(self, module: torch.nn.Module) -> None:
        check_model(module, self.dp_args.fix_model, self.train_args.backend)
        super().setup(module)
        if self.strategy == "fsdp":
            check_shardable(module, self.dist.world_size, self.train_args.backend)
        # PyTorch notes that a full backward hook fires on a layer whose input needs no
        # gradient (the first layer): Opacus's hooks want exactly that.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        # Under fsdp the hooks go on the sharded model (Opacus's order: shard, then hook).
        self.hooks = attach_hooks(module, self.dp_args.clipping, self.dp_args.max_grad_norm,
                                  sharded=self.strategy == "fsdp")
        if self.dp_args.secure_rng:  # rank 0's secret seed: every rank draws the same batches
            self._seed = self.broadcast_object(secrets.randbits(63))

    def wrap(self, runner: StepRunner) -> Optional[torch.nn.Module]:
        if self.strategy == "fsdp":  # the fsdp strategy's sharding; the step runs through it
            return super().wrap(runner)
        if self.strategy != "single":
            # Opacus's DPDDP: no gradient hooks, rank 0's weights everywhere once.
            import torch.distributed as dist
            for tensor in chain(runner.parameters(), runner.buffers()):
                dist.broadcast(tensor.data, 0)
        return None

    def batch_plan(self, plan: BatchPlan) -> BatchPlan:
        if self.dp_args.poisson_sampling:
            return PoissonPlan.from_plan(
                plan, seed=self._seed if self.dp_args.secure_rng else None)
        return PrivatePlan.from_plan(plan)

    def attach_optimizers(self, optimizers: list[torch.optim.Optimizer], num_samples: int,
                          steps_per_epoch: int) -> None:
        from opacus.optimizers import get_optimizer_class

        dp, args = self.dp_args, self.train_args
        if len(optimizers) != 1:
            raise ConfigError(
                f"trainer.backend {args.backend}: get_optimizers_schedulers returned "
                f"{len(optimizers)} optimizers; DP-SGD clips and noises one gradient: return "
                "one optimizer (with parameter groups for different learning rates)")
        world = self.dist.world_size
        self.sample_rate = min(1.0, args.train_batch_size / num_samples)
        self.delta = dp.delta if dp.delta is not None else 1.0 / num_samples
        if self.delta >= 1.0 / num_samples and not dp.allow_large_delta and dp.delta is not None:
            raise ConfigError(
                f"trainer.dp.delta {dp.delta} is >= 1/N = 1/{num_samples}: such a guarantee "
                "allows publishing a whole record; lower it (null: 1/N) or set "
                "trainer.dp.allow_large_delta: true")
        self.planned_steps = steps_per_epoch * args.epochs
        if args.max_steps is not None:
            self.planned_steps = min(self.planned_steps, args.max_steps)
        self.noise_rng = torch.Generator(device=self.device)
        self.noise_rng.manual_seed(
            int(secrets.randbits(63)) if dp.secure_rng else _noise_seed(self._seed))
        params = [p for g in optimizers[0].param_groups for p in g["params"]]
        max_norm: Any = dp.max_grad_norm
        if dp.clipping == "per_layer":  # equal shares: the total norm stays max_grad_norm
            max_norm = [dp.max_grad_norm / math.sqrt(len(params))] * len(params)
        mode = "hooks" if dp.clipping != "ghost" else (
            "ghost_fsdp" if self.strategy == "fsdp" else "ghost")
        cls = get_optimizer_class(dp.clipping if mode == "hooks" else "flat",
                                  self.strategy != "single", mode)
        # The mean over the expected global batch; distributed optimizers also divide by W.
        expected = args.train_batch_size / (world if self.strategy != "single" else 1)
        # The noise is chosen by begin_segment, before the first step (target_epsilon:
        # given what a checkpoint already spent).
        self.dp_optimizer = cls(optimizers[0], noise_multiplier=self.noise_multiplier or 0.0,
                                max_grad_norm=max_norm, expected_batch_size=expected,
                                loss_reduction="mean", generator=self.noise_rng,
                                secure_mode=dp.secure_rng)
        self.accountant = new_accountant(dp.accountant)
        self.dp_optimizer.attach_step_hook(self._account)

    def _account(self, optimizer: Any) -> None:
        """The optimizer's step hook: one step at this segment's noise and rate (what
        Opacus's ``get_optimizer_hook_fn`` adds; sailfin clips every micro-batch itself,
        so a step is one accumulated iteration), counted for the epsilon table."""
        self.accountant.step(noise_multiplier=optimizer.noise_multiplier,
                             sample_rate=self.sample_rate)
        self.accounted += 1

    def begin_segment(self, steps: int) -> Optional[str]:
        """Choose the noise of the ``steps`` steps this run may still take and build their
        epsilon table (:func:`~.privacy_budget.plan_segment`); the line to log when the
        noise changed from the checkpoint's."""
        dp = self.dp_args
        self.accounted = sum(int(h[2]) for h in self.accountant.history)
        segment = plan_segment(dp.accountant, self.accountant.history, self.sample_rate,
                               self.delta, steps, dp.noise_multiplier, dp.target_epsilon)
        self.segment, self._segment_start = segment, self.accounted
        self.noise_multiplier = self.dp_optimizer.noise_multiplier = segment.sigma
        return segment.note

    def last_allowed(self, limit: float) -> int:
        """The accounted step count after which the next step would take epsilon past
        ``limit`` (found once per segment: a binary search on its epsilon table)."""
        return self._segment_start + self.segment.table.last_within(limit)

    def teardown(self) -> None:
        if self.hooks is not None:
            self.hooks.remove_hooks()
            self.hooks = None
        super().teardown()

    # -- one step -------------------------------------------------------------------------
    def train_step(self, module: torch.nn.Module, global_step: int, batch: Any,
                   sync: bool = True) -> Any:
        if global_step != self._open_step:
            self._begin_step(global_step)
        self._last_micro = sync
        # The first forward with the hooks names an in-place change they cannot follow.
        first, self._forwarded = not self._forwarded, True
        with (naming_inplace_outputs(module, self.train_args.backend) if first else _NULL):
            # sync: fsdp reduce-scatters every micro-batch's gradient (Opacus sums them).
            out = super().train_step(module, global_step, batch, True)
        loss, rest = (out[0], out[1:]) if type(out) is tuple else (out, None)
        if isinstance(loss, torch.Tensor) and loss.dim() == 1:
            # Per-sample losses (what ghost clipping needs): the loop sees their mean.
            mean = loss.mean()
            if self.dp_args.clipping == "ghost":
                self._ghost_loss = (loss, mean)
            loss = mean
        elif self.dp_args.clipping == "ghost":
            raise ValueError(
                "trainer.dp.clipping ghost: train_step must return the per-sample losses "
                "(a 1-d tensor, e.g. F.cross_entropy(..., reduction='none')), got a tensor of "
                f"shape {tuple(getattr(loss, 'shape', ()))}")
        return loss if rest is None else (loss, *rest)

    def backward(self, loss: torch.Tensor) -> None:
        opt = self.dp_optimizer
        if self.dp_args.clipping == "ghost":
            from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping
            per_sample, returned = self._ghost_loss
            self._ghost_loss = None
            if loss is not returned:  # the loop passes a padding micro-batch's loss times 0
                per_sample = per_sample * 0.0
            # Two backward passes: per-sample norms (no per-sample gradients), then the
            # losses re-weighted by their clipping factors.
            DPTensorFastGradientClipping(self.hooks, opt, per_sample, "mean").backward()
        else:
            loss.backward()
        if not self._last_micro:
            # Clip and sum this micro-batch's per-sample gradients, then free them.
            opt.signal_skip_step(do_skip=True)
            opt.step()
            opt.zero_grad(set_to_none=True)

    def optimizer_step(self, optimizers: list[torch.optim.Optimizer]) -> bool:
        # Clip the last micro-batch, add noise (rank 0), average, account, step.
        self.dp_optimizer.step()
        self.dp_optimizer.zero_grad(set_to_none=True)  # per-sample gradients, sums, .grad
        return True

    def _begin_step(self, global_step: int) -> None:
        """A new step: drop what a step that never reached the optimizer left (a
        non-finite loss skipped it); nothing of it was released, nothing is accounted."""
        self._open_step = global_step
        if self.segment is None:  # stepped without the trainer's on_train_start
            self.begin_segment(self.planned_steps - self.accounted)
        drop_pending_step(self.dp_optimizer)

    # -- privacy spent -------------------------------------------------------------------------
    def epsilon(self, ahead: int = 0) -> Optional[float]:
        """Epsilon at ``delta`` after the steps taken (and ``ahead`` more at this segment's
        noise), read from the segment's table (see :func:`_reported`)."""
        if self.segment is not None:
            return _reported(self.segment.table(self.accounted - self._segment_start + ahead))
        return _reported(epsilon_of(self.dp_args.accountant, self.accountant.history,
                                    self.delta))

    def privacy_facts(self) -> dict[str, Any]:
        """What summary.json says of the privacy of the run: epsilon at delta, the settings,
        and each segment of constant noise and sampling rate with epsilon at its end."""
        dp, history = self.dp_args, [tuple(h) for h in self.accountant.history]
        segments = [{"noise_multiplier": sigma, "sample_rate": rate, "steps": steps,
                     "epsilon": _reported(epsilon_of(dp.accountant, history[:i + 1],
                                                     self.delta))}
                    for i, (sigma, rate, steps) in enumerate(history)]
        return {"epsilon": self.epsilon(), "delta": self.delta,
                "noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate,
                "target_epsilon": dp.target_epsilon,
                "max_grad_norm": dp.max_grad_norm, "clipping": dp.clipping,
                "poisson_sampling": dp.poisson_sampling, "accountant": dp.accountant,
                "accounted_steps": self.accounted, "segments": segments}

    # -- checkpoint state -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["dp"] = {
            "history": [list(h) for h in self.accountant.history],
            "mechanism": self.accountant.mechanism(),
            # secure_rng: a secret generator is never written down.
            "noise_rng": None if self.dp_args.secure_rng else self.noise_rng.get_state(),
            "noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate,
            "delta": self.delta}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        saved = state.get("dp")
        if saved is None:
            raise ConfigError(
                f"trainer.backend {self.train_args.backend}: the checkpoint was not trained with "
                "dp, so the privacy already spent on these weights is unknown; start from it "
                "with trainer.init_from only if its training data is not private")
        if saved["mechanism"] != self.accountant.mechanism():
            raise ConfigError(
                f"trainer.dp.accountant {self.accountant.mechanism()}: the checkpoint was "
                f"accounted with {saved['mechanism']}; keep it")
        # Past steps keep the noise and rate they were taken with; this run's noise is
        # chosen given them (begin_segment).
        self.accountant.history = [tuple(h) for h in saved["history"]]
        self.accounted = sum(int(h[2]) for h in self.accountant.history)
        self.segment = None
        if saved["noise_rng"] is not None and not self.dp_args.secure_rng:
            self.noise_rng.set_state(saved["noise_rng"])


def check_shardable(module: torch.nn.Module, world: int, backend: str) -> None:
    """Refuse parameters Opacus's FSDP optimizer cannot step: fsdp shards dimension 0, and
    a parameter whose dimension 0 is 1 loses its sharding when Opacus reshapes the noised
    gradient (DTensor treats a dimension of 1 as unshardable), so the step fails."""
    warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")
    flat = [f"{name} {list(p.shape)}" for name, p in module.named_parameters()
            if p.requires_grad and p.dim() and p.shape[0] == 1]
    if flat and world > 1:
        raise ConfigError(
            f"trainer.backend {backend}: Opacus's FSDP optimizer cannot step a parameter "
            f"whose first dimension is 1 once it is sharded over {world} ranks "
            f"({', '.join(flat)}); give such layers at least 2 outputs, or train with ddp-dp")


def _noise_seed(seed: int) -> int:
    """The noise generator's seed: apart from every other stream drawn from ``seed``."""
    hi, lo = np.random.SeedSequence([seed, 0x401CE]).generate_state(2, np.uint32)
    return (int(hi) << 31) ^ int(lo)


def _reported(eps: float) -> Optional[float]:
    """Epsilon as reported: never below 0 (a negative figure of the accountant bounds
    nothing tighter than 0); None when nothing is bounded (a noise multiplier of 0)."""
    return max(0.0, eps) if math.isfinite(eps) else None
