"""The best validation value of a run and the step it came at (summary.json's ``best``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping, Optional

from ..core.callbacks import Callback

if TYPE_CHECKING:
    from ..core.view import RunView


def flat_metrics(results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``{"val": {"acc": 1}}`` -> ``{"acc": 1, "val/acc": 1}`` (a single set also answers
    to "<set name>/<metric>"); with several sets ``{"a/acc": ...}``."""
    flat = {f"{name}/{k}": v for name, metrics in results.items() for k, v in metrics.items()}
    if len(results) == 1:
        return {**next(iter(results.values())), **flat}
    return flat


class RunStats(Callback):
    """Follows validation to keep the best value of one metric and the step it came at.
    ``metric`` as :func:`flat_metrics` names it; ``None``: ``loss`` (mode ``min``) if
    validation reports one, else nothing.

    Example::

        stats = RunStats("accuracy", "max")
        Trainer(module, args, callbacks=[stats]).train()
        stats.best   # {"metric": "accuracy", "mode": "max", "value": 0.97, "step": 340}
    """

    state_key = "run_stats"

    def __init__(self, metric: Optional[str] = None, mode: str = "min") -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        self.metric, self.mode = metric, mode
        self.best: Optional[dict[str, Any]] = None

    def on_validation_end(self, trainer: "RunView", metrics) -> None:
        flat = flat_metrics(metrics)
        key, mode = self.metric, self.mode
        if key is None:
            if "loss" not in flat:
                return
            key, mode = "loss", "min"
        if key not in flat:
            return  # a name that never matches is the checkpoint callback's error
        value = flat[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
                value):
            return
        best = self.best
        if best is None or (value < best["value"] if mode == "min" else value > best["value"]):
            self.best = {"metric": key, "mode": mode, "value": float(value),
                         "step": trainer.global_step}

    # -- carried in checkpoints: a resumed run still knows its best so far ---------------
    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best = state.get("best")

