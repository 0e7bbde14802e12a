"""``trainer.checkpoint.every_n_steps: auto``: the save interval from what saves cost and
how often the run fails, by Young and Daly's ``tau = sqrt(2 * save * MTBF)`` (see
docs/goodput.md), chosen again after every save, the same on every rank.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch

from ...utils.voice import say
from ...logging.time_account_file import account_path, account_totals, read_account
from .memory_snapshots import MemorySnapshots
from .saver import CheckpointCallback

if TYPE_CHECKING:
    from ..core.view import RunView

DEFAULT_MTBF_HOURS = 24.0
_SMOOTH = 0.5    # weight of the newest measurement
_CHANGED = 0.25  # say the interval again when it moves by more than this share
# The first step costs many steady ones: the step clock starts after it, and the first
# save (which measures a save) comes after a few steady steps.
WARMUP_STEPS = 1
MEASURED_STEPS = 4


def young_daly_seconds(save_seconds: float, mtbf_seconds: float) -> float:
    """The optimal seconds of training between saves: ``sqrt(2 * save * MTBF)``."""
    return math.sqrt(2.0 * max(save_seconds, 0.0) * max(mtbf_seconds, 0.0))


class IntervalChooser:
    """The measurements and the chosen interval of one kind of save (``checkpoint`` or
    ``memory snapshot``): the callback that saves calls :meth:`start` before the first
    step, asks :meth:`due` after each and reports each save to :meth:`saved`."""

    def __init__(self, kind: str, mtbf_hours: Optional[float]) -> None:
        self.kind, self.mtbf_hours = kind, mtbf_hours
        self.save_seconds: Optional[float] = None
        self.step_seconds: Optional[float] = None
        self.every: Optional[int] = None
        self.choice: Optional[dict[str, Any]] = None
        self._next = 0
        self._warm = -1  # the step after which the step clock starts (no measurements yet)
        self._mark = (0.0, 0, 0.0)  # (clock, step, stall seconds so far) after a save

    def start(self, trainer: "RunView", stalled: float) -> None:
        """Before the first step: choose from the resumed measurements, or save after a
        warm-up step and a few steady ones, to measure."""
        self._mark = (time.perf_counter(), trainer.global_step, stalled)
        if self.save_seconds is not None and self.step_seconds is not None:
            self.choose(trainer)
        else:
            self._warm = trainer.global_step + WARMUP_STEPS
            self._next = self._warm + MEASURED_STEPS

    def due(self, step: int, stalls: list[float]) -> bool:
        """Whether to save after ``step``; ``stalls``: every save's stall so far."""
        if step == self._warm:  # the warm-up is over: the step clock starts now
            self._mark = (time.perf_counter(), step, sum(stalls))
        return step >= self._next

    def saved(self, trainer: "RunView", started: float, stalls: list[float],
              new_save: bool) -> None:
        """After the save that :meth:`due` asked for began at ``started``; ``stalls`` is
        every save's stall so far (the last one this save's if ``new_save``)."""
        clock, step, stalled = self._mark
        steps = trainer.global_step - step
        if new_save and steps > 0:
            # Training time per step since the last save, other saves (epoch ends) left out.
            other_saves = sum(stalls[:-1]) - stalled
            step_time = max(0.0, started - clock - other_saves) / steps
            self.save_seconds = _smooth(self.save_seconds, stalls[-1])
            self.step_seconds = _smooth(self.step_seconds, step_time)
        self._mark = (time.perf_counter(), trainer.global_step, sum(stalls))
        self.choose(trainer)

    def choose(self, trainer: "RunView") -> None:
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
        # The measurements as they were used (unrounded): the choice can be recomputed
        # from what summary.json reports.
        self.choice = {"every_n_steps": every, "seconds": round(tau, 3),
                       "save_seconds": save, "step_seconds": step,
                       "mtbf_hours": round(mtbf / 3600, 6), "mtbf_from": source,
                       "at_step": trainer.global_step}
        if changed and trainer.dist.is_main:
            key = ("trainer.checkpoint.every_n_steps" if self.kind == "checkpoint"
                   else "trainer.checkpoint.memory.every_n_steps")  # the setting that is auto
            say(f"{key} auto: a {self.kind} every {every} step(s) (~{tau:.3g} s of "
                f"training): one takes {save:.3g} s, a step {1000 * step:.3g} ms, MTBF "
                f"{mtbf / 3600:.3g} h ({source}); Young-Daly sqrt(2 x save x MTBF)")

    def _mtbf(self, trainer: "RunView") -> tuple[float, str]:
        if self.mtbf_hours is not None:
            return self.mtbf_hours * 3600.0, "trainer.checkpoint.mtbf_hours"
        if not trainer.dist.is_main:
            return 0.0, ""
        account, _ = read_account(account_path(trainer.args.output_dir))
        totals = account_totals(account or {})
        failures, wall = totals["failures"], totals["wall_seconds"]
        if failures:
            return wall / failures, f"{failures} failure(s) in this run's {wall:.4g} s"
        return DEFAULT_MTBF_HOURS * 3600.0, (
            "no failure seen yet and trainer.checkpoint.mtbf_hours is null: assumed")

    def state_dict(self) -> dict[str, Any]:
        return {"save_seconds": self.save_seconds, "step_seconds": self.step_seconds}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.save_seconds = state.get("save_seconds")
        self.step_seconds = state.get("step_seconds")


class AutoStepCheckpointCallback(CheckpointCallback):
    """Saves every N steps, N chosen by :func:`young_daly_seconds` from measurements
    (carried in checkpoints: a resumed run chooses at once).

    Example::

        args = TrainerArguments(checkpoint={"every_n_steps": "auto", "mtbf_hours": 12})
        Trainer(module, args).train()   # "... auto: a checkpoint every 240 step(s) ..."
    """

    def __init__(self, checkpointer: Any, args: Any) -> None:
        super().__init__(checkpointer, args)
        self.interval = IntervalChooser("checkpoint", args.mtbf_hours)

    def on_train_start(self, trainer: "RunView") -> None:
        super().on_train_start(trainer)
        self.interval.start(trainer, sum(self.stall_seconds))

    def on_step_end(self, trainer: "RunView") -> None:
        if not self.interval.due(trainer.global_step, self.stall_seconds):
            return
        started, saves = time.perf_counter(), len(self.stall_seconds)
        self.save(trainer)
        self.interval.saved(trainer, started, self.stall_seconds,
                            len(self.stall_seconds) > saves)

    def summary_fields(self) -> dict[str, Any]:
        return {"checkpoint_interval": self.interval.choice}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **self.interval.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.interval.load_state_dict(state)


class AutoMemorySnapshots(MemorySnapshots):
    """Memory snapshots every N steps, N chosen like :class:`AutoStepCheckpointCallback`'s
    from what a snapshot holds the step for (``trainer.checkpoint.memory.every_n_steps:
    auto``)."""

    state_key = "memory_snapshot_interval"

    def __init__(self, store: Any, args: Any, saver: Any) -> None:
        super().__init__(store, args, saver)
        self.interval = IntervalChooser("memory snapshot", args.checkpoint.mtbf_hours)

    def on_train_start(self, trainer: "RunView") -> None:
        super().on_train_start(trainer)
        self.interval.start(trainer, sum(self.stall_seconds))

    def on_step_end(self, trainer: "RunView") -> None:
        step = trainer.global_step
        if self.interval.due(step, self.stall_seconds):
            started = time.perf_counter()
            self.snapshot(trainer)
            self.interval.saved(trainer, started, self.stall_seconds, True)
        if self.persist and step % self.persist == 0:
            self.saver.save(trainer)

    def summary_fields(self) -> dict[str, Any]:
        return {"memory_snapshot_interval": self.interval.choice}

    def state_dict(self) -> dict[str, Any]:
        return self.interval.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.interval.load_state_dict(state)


def _smooth(old: Optional[float], new: float) -> float:
    return new if old is None else _SMOOTH * new + (1 - _SMOOTH) * old

