"""``trainer.early_stopping``: end the run when validation stops improving."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping, Optional

from ...config.errors import ConfigError, suggest
from ...config.loop import EarlyStoppingArguments
from ...utils.voice import say
from ..core.callbacks import Callback
from .run_stats import flat_metrics

if TYPE_CHECKING:
    from ..core.view import RunView


class EarlyStopping(Callback):
    """Counts validations without improvement; at ``patience`` it asks the trainer to stop
    (the run then ends as at its last step; ``summary.json``'s ``stopped_early`` says
    why). The count and the best value travel in checkpoints: a resumed run goes on
    counting, and one that had stopped stops again at once (raise ``patience``)."""

    state_key = "early_stopping"

    def __init__(self, args: EarlyStoppingArguments) -> None:
        if args.metric is None:
            raise ValueError("EarlyStopping needs EarlyStoppingArguments.metric")
        self.args = args
        self.best: Optional[float] = None
        self.best_step: Optional[int] = None
        self.bad_validations = 0  # in a row, since the best

    def on_train_start(self, trainer: "RunView") -> None:
        if self.bad_validations >= self.args.patience:  # resumed from a stopped run
            self._stop(trainer, resumed=True)

    def on_validation_end(self, trainer: "RunView",
                          metrics: Mapping[str, Mapping[str, float]]) -> None:
        flat, key = flat_metrics(metrics), self.args.metric
        if key not in flat:
            raise ConfigError(f"trainer.early_stopping.metric {key!r} is not among the "
                              f"validation metrics{suggest(str(key), flat)}: "
                              f"{', '.join(sorted(flat))}")
        value = flat[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"trainer.early_stopping.metric {key!r} is {value!r}, not a number")
        value, delta = float(value), self.args.min_delta
        # A non-finite value (a NaN loss) never improves.
        if math.isfinite(value) and (self.best is None or (
                value < self.best - delta if self.args.mode == "min"
                else value > self.best + delta)):
            self.best, self.best_step, self.bad_validations = value, trainer.global_step, 0
            return
        self.bad_validations += 1
        if self.bad_validations >= self.args.patience:
            self._stop(trainer)

    def _stop(self, trainer: "RunView", resumed: bool = False) -> None:
        args = self.args
        best = ("no finite value yet" if self.best is None
                else f"its best {self.best:.6g} (step {self.best_step})")
        reason = (f"early stopping: {args.metric} did not improve on {best} by more than "
                  f"min_delta {args.min_delta:g} in {self.bad_validations} validations "
                  f"(patience {args.patience}, mode {args.mode})")
        trainer.stop_reason = {"reason": reason, "step": trainer.global_step,
                               "metric": args.metric, "best": self.best,
                               "best_step": self.best_step}
        if trainer.dist.is_main:
            say(f"{reason}; {'the resumed run had stopped' if resumed else 'stopping'} at "
                f"step {trainer.global_step}", warning=True)

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step,
                "bad_validations": self.bad_validations}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best, self.best_step = state.get("best"), state.get("best_step")
        self.bad_validations = int(state.get("bad_validations", 0))
