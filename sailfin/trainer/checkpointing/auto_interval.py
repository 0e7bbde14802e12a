"""``trainer.checkpoint.every_n_steps: auto``: the save interval from what saves cost and
how often the run fails.

A save every ``tau`` seconds of training costs ``save / tau`` of the time; a failure
loses on average ``tau / 2`` of training. The sum is least at Young and Daly's
``tau = sqrt(2 * save * MTBF)``. ``save`` is the measured stall of this run's saves,
``MTBF`` is ``trainer.checkpoint.mtbf_hours`` or, when that is null, the wall time
per failure this run's time account has seen (24 hours until it has seen one).
The interval in steps is ``tau`` over the measured step time, chosen again after
every save (the measurements move: a larger state, a slower disk, a first failure),
the same on every rank (one small all-reduce per save), and said when it changes.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch

from ...checkpoint.checkpointer import say
from ...checkpoint.time_account_file import account_path, account_totals, read_account
from .saver import CheckpointCallback

if TYPE_CHECKING:
    from ..core.trainer import Trainer

DEFAULT_MTBF_HOURS = 24.0
_SMOOTH = 0.5    # weight of the newest measurement
_CHANGED = 0.25  # say the interval again when it moves by more than this share


def young_daly_seconds(save_seconds: float, mtbf_seconds: float) -> float:
    """The optimal seconds of training between saves: ``sqrt(2 * save * MTBF)``."""
    return math.sqrt(2.0 * max(save_seconds, 0.0) * max(mtbf_seconds, 0.0))


class AutoStepCheckpointCallback(CheckpointCallback):
    """Saves every N steps, N chosen by :func:`young_daly_seconds` from measurements.

    The first save comes after the first step (it measures what a save costs)
    unless the checkpoint resumed from carries the measurements.

    Example::

        args = TrainerArguments(checkpoint={"every_n_steps": "auto", "mtbf_hours": 12})
        Trainer(module, args).train()   # "checkpoint every_n_steps auto: every 240 steps ..."
    """

    def __init__(self, checkpointer: Any, args: Any) -> None:
        super().__init__(checkpointer, args)
        self.save_seconds: Optional[float] = None
        self.step_seconds: Optional[float] = None
        self.every: Optional[int] = None
        self.choice: Optional[dict[str, Any]] = None
        self._next = 0
        self._mark = (0.0, 0, 0.0)  # (clock, step, stall seconds so far) after a save

    def on_train_start(self, trainer: "Trainer") -> None:
        super().on_train_start(trainer)
        self._mark = (time.perf_counter(), trainer.global_step, sum(self.stall_seconds))
        if self.save_seconds is not None and self.step_seconds is not None:
            self._choose(trainer)  # the resumed checkpoint's measurements
        else:
            self._next = trainer.global_step + 1

    def on_step_end(self, trainer: "Trainer") -> None:
        if trainer.global_step < self._next:
            return
        started = time.perf_counter()
        saves_before = len(self.stall_seconds)
        self.save(trainer)
        clock, step, stalled = self._mark
        steps = trainer.global_step - step
        if len(self.stall_seconds) > saves_before and steps > 0:
            # Training time per step since the last save, other saves (epoch ends) left out.
            other_saves = sum(self.stall_seconds[:saves_before]) - stalled
            step_time = max(0.0, started - clock - other_saves) / steps
            self.save_seconds = _smooth(self.save_seconds, self.stall_seconds[-1])
            self.step_seconds = _smooth(self.step_seconds, step_time)
        self._mark = (time.perf_counter(), trainer.global_step, sum(self.stall_seconds))
        self._choose(trainer)

    # -- the choice -----------------------------------------------------------------------
    def _choose(self, trainer: "Trainer") -> None:
        mtbf, source = self._mtbf(trainer)
        # Every rank saves at the same steps: they agree on the measurements (their mean).
        mine = torch.tensor([self.save_seconds or 0.0, self.step_seconds or 0.0,
                             mtbf if trainer.dist.is_main else 0.0],
                            dtype=torch.float64, device=trainer.device)
        save, step, mtbf_mean = trainer.backend.all_reduce_mean(mine).tolist()
        mtbf = mtbf_mean * trainer.dist.world_size
        tau = young_daly_seconds(save, mtbf)
        every = max(1, round(tau / step)) if step > 0 else 1
        self._next = trainer.global_step + every
        changed = self.every is None or abs(every - self.every) > _CHANGED * self.every
        self.every = every
        self.choice = {"every_n_steps": every, "seconds": round(tau, 3),
                       "save_seconds": round(save, 4), "step_seconds": round(step, 6),
                       "mtbf_hours": round(mtbf / 3600, 6), "mtbf_from": source,
                       "at_step": trainer.global_step}
        if changed and trainer.dist.is_main:
            say(f"checkpoint every_n_steps auto: every {every} step(s) (~{tau:.3g} s of "
                f"training): a save takes {save:.3g} s, a step {1000 * step:.3g} ms, MTBF "
                f"{mtbf / 3600:.3g} h ({source}); Young-Daly sqrt(2 x save x MTBF)")

    def _mtbf(self, trainer: "Trainer") -> tuple[float, str]:
        if self.args.mtbf_hours is not None:
            return self.args.mtbf_hours * 3600.0, "trainer.checkpoint.mtbf_hours"
        if not trainer.dist.is_main:
            return 0.0, ""
        account, _ = read_account(account_path(trainer.args.output_dir))
        segments = account["segments"] if account else []
        failures = sum(1 for s in segments if s.get("failure"))
        if failures:
            wall = account_totals(account)["wall_seconds"]  # type: ignore[arg-type]
            return wall / failures, f"{failures} failure(s) in this run's {wall:.4g} s"
        return DEFAULT_MTBF_HOURS * 3600.0, (
            "no failure seen yet and trainer.checkpoint.mtbf_hours is null: assumed")

    def summary_fields(self) -> dict[str, Any]:
        return {"checkpoint_interval": self.choice}

    # -- carried in checkpoints: a resumed run chooses at once ------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "save_seconds": self.save_seconds,
                "step_seconds": self.step_seconds}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.save_seconds = state.get("save_seconds")
        self.step_seconds = state.get("step_seconds")


def _smooth(old: Optional[float], new: float) -> float:
    return new if old is None else _SMOOTH * new + (1 - _SMOOTH) * old

