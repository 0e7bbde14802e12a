"""The ``trainer.dp:`` section: differentially private training (the ``*-dp`` backends)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional, get_args, get_type_hints

from .errors import ConfigError, short_repr, suggest

# Above this target_epsilon, a run's guarantee is no privacy worth the name: e**100 bounds
# no likelihood ratio a reader could notice. Refused unless allow_weak_privacy (docs/dp.md).
WEAK_EPSILON = 100.0

# Backend names that train with DP-SGD: a strategy composed with ``dp``.
DP_SUFFIX = "-dp"


def is_private(backend: str) -> bool:
    """Whether ``trainer.backend`` trains with differential privacy (``sp-dp``, ``ddp-dp``,
    ``fsdp-dp``)."""
    return backend.endswith(DP_SUFFIX)


@dataclass
class DPArguments:
    """DP-SGD settings: per-sample clipping, Gaussian noise, Poisson sampling, accounting.

    Exactly one of ``noise_multiplier`` and ``target_epsilon`` is set. The sampling
    rate is ``train_batch_size / len(train dataset)`` whatever the world size.

    Example::

        trainer:
          backend: sp-dp
          dp: {target_epsilon: 3.0, max_grad_norm: 1.0}
    """

    noise_multiplier: Optional[float] = None
    """Noise standard deviation over the clipping norm (sigma). Null: from target_epsilon."""
    target_epsilon: Optional[float] = None
    """Epsilon the whole run (epochs, or max_steps) spends at ``delta``, a bound across
    resumes: the noise of the steps to come is chosen given what a checkpoint already
    spent, or the run stops before its first step. Null: noise_multiplier is given."""
    max_grad_norm: float = 1.0
    """Each sample's gradient is clipped to this L2 norm (per_layer: the norm over all
    layers, split equally between the parameters)."""
    delta: Optional[float] = None
    """The delta of (epsilon, delta)-DP. Null: 1 / len(train dataset)."""
    poisson_sampling: bool = True
    """Each optimizer step takes every sample independently with probability
    train_batch_size / N (what the accounting assumes). False: shuffled fixed-size
    batches (epsilon is then an approximation; see docs/dp.md)."""
    clipping: Literal["flat", "per_layer", "ghost"] = "flat"
    """flat: one norm over all parameters; per_layer: one per parameter tensor; ghost:
    Opacus's fast gradient clipping (no per-sample gradients held: less memory; train_step
    returns the per-sample losses)."""
    secure_rng: bool = False
    """Seeds for the noise and the Poisson draws come from the OS's random source at every
    start, and noise is drawn the floating-point-attack-resistant way. No exact resume."""
    fix_model: bool = False
    """Replace layers Opacus cannot train privately (BatchNorm -> GroupNorm) with Opacus's
    ModuleValidator fixers before training, instead of refusing the model."""
    max_epsilon: Optional[float] = None
    """Stop training (or refuse to start) before a step would take epsilon past this."""
    allow_large_delta: bool = False
    """Accept delta >= 1/N (a guarantee that allows leaking a whole record)."""
    allow_weak_privacy: bool = False
    """Accept a target_epsilon above 100 (WEAK_EPSILON): a bound that bounds nothing in
    practice, whose solved noise is next to none."""
    accountant: Literal["rdp", "prv", "gdp"] = "rdp"
    """Opacus accountant that turns the step history into epsilon."""

    def __post_init__(self) -> None:
        hints = get_type_hints(type(self))
        for name in ("clipping", "accountant"):
            allowed = get_args(hints[name])
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(f"trainer.dp.{name} is {short_repr(value)}"
                                  f"{suggest(value, allowed)};"
                                  f" expected one of: {', '.join(allowed)}")
        if not _positive(self.max_grad_norm):
            raise ConfigError(f"trainer.dp.max_grad_norm must be > 0 (the per-sample clipping "
                              f"norm), got {self.max_grad_norm}")
        for name in ("noise_multiplier", "target_epsilon", "max_epsilon"):
            value = getattr(self, name)
            if value is not None and not _positive(value):
                raise ConfigError(f"trainer.dp.{name} must be > 0 or null, got {value}"
                                  + (" (no noise is no privacy: use trainer.backend sp)"
                                     if name == "noise_multiplier" else ""))
        if (self.target_epsilon is not None and self.target_epsilon > WEAK_EPSILON
                and not self.allow_weak_privacy):
            raise ConfigError(
                f"trainer.dp.target_epsilon {self.target_epsilon:g} promises no meaningful "
                f"privacy (above {WEAK_EPSILON:g}, e**epsilon bounds nothing: the solved noise "
                f"is next to none); set a target of at most {WEAK_EPSILON:g} (1 to 10 is "
                "usual), or set trainer.dp.allow_weak_privacy: true to train anyway")
        if self.delta is not None and not (0 < self.delta < 1):
            raise ConfigError(f"trainer.dp.delta must be in (0, 1) or null (1/N), "
                              f"got {self.delta}")

    def check_for(self, backend: str) -> None:
        """Settings that depend on the backend: DP needs one noise source; not DP needs
        no dp section."""
        if not is_private(backend):
            if self != DPArguments():
                raise ConfigError(f"trainer.dp is set but trainer.backend {backend} does not "
                                  f"train privately; use {backend.split('-')[0]}-dp, or remove "
                                  "trainer.dp")
            return
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ConfigError(
                f"trainer.backend {backend} needs exactly one of trainer.dp.noise_multiplier "
                "and trainer.dp.target_epsilon (got "
                + ("both" if self.noise_multiplier is not None else "neither") + ")")


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value) and value > 0
