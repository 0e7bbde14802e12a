"""The privacy spent, where a run reports it: epsilon with the step's metrics (and so in
the progress line and ``sailfin report``), in summary.json, and ``max_epsilon``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...config.dp import DPArguments
from ...config.errors import ConfigError
from ..core.callbacks import Callback

if TYPE_CHECKING:
    from ..core.view import RunView


class PrivacyCallback(Callback):
    """Logs epsilon at ``delta`` every ``log_every_n_steps``, stops the run before a step
    would spend more than ``trainer.dp.max_epsilon``, and adds ``privacy`` to summary.json.
    The accountant itself is backend state (in every checkpoint).

    Example (the trainer adds it for a ``*-dp`` backend)::

        Trainer(module, TrainerArguments(backend="sp-dp", dp={"noise_multiplier": 1.0}))
    """

    def __init__(self, args: DPArguments, log_every: int) -> None:
        self.args = args
        self.log_every = log_every
        self.backend: Any = None

    def on_train_start(self, trainer: "RunView") -> None:
        self.backend = trainer.backend
        limit = self.args.max_epsilon
        if limit is None:
            return
        upcoming = self.backend.epsilon(extra_steps=1)
        if upcoming > limit and trainer.global_step == 0:
            raise ConfigError(
                f"trainer.dp.max_epsilon {limit}: the first step alone spends epsilon "
                f"{upcoming:.4g} (noise_multiplier {self.backend.noise_multiplier:.4g}, sampling "
                f"rate {self.backend.sample_rate:.4g}); raise the noise or max_epsilon")
        self._stop_if_over(trainer, upcoming)

    def on_step_end(self, trainer: "RunView") -> None:
        if trainer.global_step % self.log_every == 0:
            trainer.writers.log_metrics({"epsilon": self.backend.epsilon()},
                                        trainer.global_step, trainer.epoch, "train")
        if self.args.max_epsilon is not None:
            self._stop_if_over(trainer, self.backend.epsilon(extra_steps=1))

    def _stop_if_over(self, trainer: "RunView", upcoming: float) -> None:
        if upcoming > self.args.max_epsilon:
            trainer.stop_reason = {"reason": "max_epsilon", "step": trainer.global_step,
                                   "epsilon": self.backend.epsilon(),
                                   "next_step_epsilon": upcoming,
                                   "max_epsilon": self.args.max_epsilon}

    def summary_fields(self) -> dict[str, Any]:
        """summary.json's ``privacy``: epsilon, delta, noise, sampling rate, steps."""
        return {"privacy": self.backend.privacy_facts()} if self.backend is not None else {}
