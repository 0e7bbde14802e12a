"""The privacy spent, where a run reports it: epsilon with the step's metrics (and so in
the progress line and ``sailfin report``), in summary.json, and ``max_epsilon``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from ...config.dp import DPArguments
from ...config.errors import ConfigError
from ...utils.voice import say
from ..core.callbacks import Callback
from ..safety.startup_checks import steps_left

if TYPE_CHECKING:
    from ..core.view import RunView


class PrivacyCallback(Callback):
    """Has the backend choose this run's noise for the steps it may still take
    (``target_epsilon`` bounds the whole run, across resumes); logs epsilon every
    ``log_every_n_steps``, stops the run before it passes ``trainer.dp.max_epsilon``, and
    puts ``privacy`` in summary.json (the accountant itself is backend state). The
    trainer adds it for a ``*-dp`` backend."""

    def __init__(self, args: DPArguments, log_every: int) -> None:
        self.args = args
        self.log_every = log_every
        self.backend: Any = None
        self.stop_after: Optional[int] = None  # accounted steps that fit max_epsilon

    def on_train_start(self, trainer: "RunView") -> None:
        self.backend = trainer.backend
        note = self.backend.begin_segment(steps_left(trainer))
        if note and trainer.dist.is_main:
            say(note, warning=True)
        limit = self.args.max_epsilon
        if limit is None:
            return
        self.stop_after = self.backend.last_allowed(limit)
        if self.stop_after <= self.backend.accounted and trainer.global_step == 0:
            raise ConfigError(
                f"trainer.dp.max_epsilon {limit}: the first step alone spends epsilon "
                f"{self.backend.epsilon(ahead=1):.4g} (noise_multiplier "
                f"{self.backend.noise_multiplier:.4g}, sampling rate "
                f"{self.backend.sample_rate:.4g}); raise the noise or max_epsilon")
        self._stop_if_over(trainer)

    def on_step_end(self, trainer: "RunView") -> None:
        if trainer.global_step % self.log_every == 0:
            eps = self.backend.epsilon()
            if eps is not None:  # a noise multiplier of 0 bounds nothing
                trainer.writers.log_metrics({"epsilon": eps}, trainer.global_step,
                                            trainer.epoch + 1, "train")  # inside it, from 1
        if self.stop_after is not None:
            self._stop_if_over(trainer)

    def _stop_if_over(self, trainer: "RunView") -> None:
        backend = self.backend
        if backend.accounted >= self.stop_after:
            trainer.stop_reason = {
                "reason": "max_epsilon", "step": trainer.global_step,
                "epsilon": backend.epsilon(),
                "next_step_epsilon": backend.epsilon(ahead=1),
                "max_epsilon": self.args.max_epsilon}

    def summary_fields(self) -> dict[str, Any]:
        """summary.json's ``privacy``: epsilon, delta, noise, sampling rate, segments."""
        return {"privacy": self.backend.privacy_facts()} if self.backend is not None else {}

