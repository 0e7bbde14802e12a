"""When to save: every N steps, at epoch end, when the best metric improves, at the end."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import time
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch

from ...checkpoint import CheckpointError, Checkpointer, SaveRequest
from ...checkpoint.errors import causes, no_space
from .config_diff import recipe_spec
from ...checkpoint.rng import rng_state
from ...checkpoint.serialize import check_plain
from ...checkpoint.dcp_io import split_sharded
from ...checkpoint.staging import optimizer_storages
from ...config.checkpoint import CheckpointArguments
from ...config.errors import suggest
from ...distributed.watchdog import CHECKPOINT_SAVE
from ...version import __version__
from ..core.callbacks import Callback, notify_save_end
from .state import state_key, trainer_state

if TYPE_CHECKING:
    from ..core.view import RunView


class CheckpointCallback(Callback):
    """Saves the trainer's state through a :class:`Checkpointer` at the configured moments;
    ``stall_seconds``: how long training waited for each save.

    Example::

        callback = checkpoint_callback(checkpointer, CheckpointArguments(at_epoch_end=True))
        Trainer(module, args, callbacks=[callback])   # the trainer adds one itself from args
    """

    state_key = "checkpoint"  # the same key whether or not it saves by step count

    def __init__(self, checkpointer: Checkpointer, args: CheckpointArguments) -> None:
        self.checkpointer = checkpointer
        self.args = args
        self.best_value: Optional[float] = None
        self.best_step: Optional[int] = None
        self.stall_seconds: list[float] = []
        self._improved = False   # the best metric improved since the last save
        self._saved_step = -1
        self.settler: Optional[Callback] = None  # async saves: AsyncCopySettler, in the loop

    def on_validation_end(self, trainer: "RunView",
                          metrics: Mapping[str, Mapping[str, float]]) -> None:
        if not self.args.best_metric:
            return
        value = pick_metric(metrics, self.args.best_metric)
        if value is None or not math.isfinite(value):
            return
        better = (self.best_value is None
                  or (value < self.best_value if self.args.best_mode == "min"
                      else value > self.best_value))
        if better:
            self.best_value, self.best_step = value, trainer.global_step
            self._improved = True
            if trainer.args.val_every_n_steps and trainer.step_in_epoch < trainer.steps_per_epoch:
                # Validated inside an epoch (val_every_n_steps): no epoch end follows
                # before the weights move on, so the best is saved now.
                self.save(trainer)

    def on_epoch_end(self, trainer: "RunView") -> None:
        if self.args.at_epoch_end or self._improved:
            self.save(trainer)

    def on_train_start(self, trainer: "RunView") -> None:
        # Resumed from a checkpoint of this directory: that step is saved already. Saving
        # it again (a finished run started again) would only put it at risk.
        loaded = getattr(trainer, "resumed_from", None)
        if loaded is not None and loaded.name in self.checkpointer.candidates():
            self._saved_step = trainer.global_step

    def on_train_end(self, trainer: "RunView") -> None:
        # The final state, so that a longer run (more epochs or max_steps) continues exactly.
        if self.args.every_n_steps or self.args.at_epoch_end or self._improved:
            self.save(trainer)
        try:
            self.checkpointer.wait()
        except CheckpointError as exc:
            raise self._failed(trainer, exc) from exc

    def save(self, trainer: "RunView") -> None:
        """Save now (unless this step is saved already and nothing improved since)."""
        if trainer.global_step == self._saved_step and not self._improved:
            return
        started = time.perf_counter()
        trainer.nonfinite.check()  # never save weights a non-finite loss already spoiled
        trainer.writers.flush()  # metrics.jsonl holds every event up to the saved step
        # Model and optimizers go to DCP under PyTorch's distributed state dicts' names
        # (the optimizers' state is built once, in that form).
        state = trainer_state(trainer, named_optimizers=True)
        for key, value in state.items():  # refuse now what a resume could not load
            check_plain(value, "module.get_state()" if key == "module_state"
                        else f"Trainer.state_dict()[{key!r}]")
        facts = manifest_facts(trainer, self, state)
        sharded = split_sharded(state, {state_key(c) for c in trainer.callbacks
                                        if getattr(c, "state_in_dcp", False)})
        if not getattr(self.checkpointer, "writes_shards", False):
            raise CheckpointError(
                f"{type(self.checkpointer).__name__} cannot write the model's state with DCP: "
                "subclass sailfin.checkpoint.DirectoryCheckpointer for "
                "trainer.checkpoint.class_path")
        # async: the optimizers' state is copied during the next forward and backward.
        later = optimizer_storages(trainer.optimizers) if self.settler else frozenset()
        request = SaveRequest(step=trainer.global_step, facts=facts, shared={"trainer": state},
                              rank_state=rng_state(), is_best=self._improved, sharded=sharded,
                              later=later)
        beat = trainer.heartbeat
        phase, beat.phase = beat.phase, CHECKPOINT_SAVE  # the watchdog's slow-phase limit
        try:
            self.checkpointer.save(request)
        except (OSError, CheckpointError) as exc:
            failure = self._failed(trainer, exc)
            if sharded and getattr(exc, "every_rank", False):
                self.checkpointer.barrier()  # DCP failed on every rank: leave together
            # Else one rank failed alone (rank 0's commit): it leaves, and the others'
            # next collective ends with it, rather than a barrier nobody else joins.
            raise failure from exc
        finally:
            beat.phase = phase
        self._saved_step, self._improved = trainer.global_step, False
        self.stall_seconds.append(time.perf_counter() - started)
        notify_save_end(trainer, "checkpoint", self.stall_seconds[-1])  # the time account

    def _failed(self, trainer: "RunView", exc: BaseException) -> CheckpointError:
        """Remove the failed save's partial files (a full disk stays full otherwise) and
        say in one line what failed and what is kept."""
        with contextlib.suppress(OSError):  # the message below still names the directory
            self.checkpointer.abort()
        kept = self.checkpointer.latest()
        kept_text = (f"the previous checkpoint {kept} is kept" if kept
                     else "no earlier checkpoint exists")
        if no_space(exc):
            return CheckpointError(
                f"saving step {_failed_step(exc, trainer.global_step)} to "
                f"{self.checkpointer.location} failed: "
                f"no space left on device; removed the partial save, {kept_text}. Free space "
                "there, or set trainer.checkpoint.dir (or keep_last) to need less")
        if isinstance(exc, CheckpointError):
            return CheckpointError(f"{exc}; removed the partial save, {kept_text}")
        return CheckpointError(f"saving step {trainer.global_step} to "
                               f"{self.checkpointer.location} failed: {exc}; removed the "
                               f"partial save, {kept_text}")

    def state_dict(self) -> dict[str, Any]:
        return {"best_value": self.best_value, "best_step": self.best_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best_value = state.get("best_value")
        self.best_step = state.get("best_step")
        self._saved_step = -1


class StepCheckpointCallback(CheckpointCallback):
    """Also saves every ``every_n_steps`` optimizer steps (a class of its own: runs without
    step saves make no call per step)."""

    def on_step_end(self, trainer: "RunView") -> None:
        if trainer.global_step % self.args.every_n_steps == 0:  # type: ignore[operator]
            self.save(trainer)


class AsyncCopySettler(Callback):
    """With ``async_save``: before each optimizer step, wait for the copy of the
    optimizers' state the last save left to a thread (a callback of its own: runs without
    async saves make no call per step)."""

    def __init__(self, saver: CheckpointCallback) -> None:
        self.saver = saver

    def on_backward_end(self, trainer: "RunView", samples: int) -> bool:
        started = time.perf_counter()
        try:
            waited = self.saver.checkpointer.settle()
        except CheckpointError as exc:
            raise self.saver._failed(trainer, exc) from exc
        if waited:  # part of the last save's stall (the time account's too)
            seconds = time.perf_counter() - started
            self.saver.stall_seconds[-1] += seconds
            notify_save_end(trainer, "checkpoint copy", seconds)
        return False


def _failed_step(exc: BaseException, default: int) -> int:
    """The step whose save failed: an asynchronous save's failure is seen a save later;
    the file it names (``.tmp-step-00000003/...``) says which."""
    for e in causes(exc):
        match = re.search(r"step-(\d+)", str(getattr(e, "file", "") or ""))
        if match:
            return int(match.group(1))
    return default


def checkpoint_callback(checkpointer: Checkpointer, args: CheckpointArguments
                        ) -> Optional[CheckpointCallback]:
    """The callback ``args`` asks for, or None when nothing triggers a save."""
    if not args.saves:
        return None
    if args.every_n_steps == "auto":  # chosen from measurements (auto_interval.py)
        from .auto_interval import AutoStepCheckpointCallback
        return AutoStepCheckpointCallback(checkpointer, args)
    cls = StepCheckpointCallback if args.every_n_steps else CheckpointCallback
    return cls(checkpointer, args)


def checkpoint_callbacks(saver: Optional[CheckpointCallback]) -> list[Callback]:
    """The saver, and with ``async_save`` what settles its copies before each step."""
    if saver is None or not saver.args.async_save:
        return [saver] if saver is not None else []
    saver.settler = AsyncCopySettler(saver)
    return [saver, saver.settler]


def pick_metric(metrics: Mapping[str, Mapping[str, float]], name: str) -> Optional[float]:
    """``accuracy`` (one validation set) or ``<set>/accuracy``; error if it is not there."""
    available = [f"{s}/{m}" for s, values in metrics.items() for m in values]
    if not metrics:
        return None
    if "/" in name:
        dataset, metric = name.split("/", 1)
        values = metrics.get(dataset, {})
    elif len(metrics) == 1:
        dataset, metric = next(iter(metrics)), name
        values = next(iter(metrics.values()))
    else:
        raise CheckpointError(f"trainer.checkpoint.best_metric {name!r} is ambiguous with "
                              f"{len(metrics)} validation sets; name one of: "
                              f"{', '.join(sorted(available))}")
    if metric not in values:
        raise CheckpointError(f"trainer.checkpoint.best_metric {name!r} is not among the "
                              f"validation metrics of this run"
                              f"{suggest(name, available + list(values))}: "
                              f"{', '.join(sorted(available))}")
    value = values[metric]
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def manifest_facts(trainer: "RunView", callback: CheckpointCallback,
                   state: Mapping[str, Any], config: Optional[dict[str, Any]] = None
                   ) -> dict[str, Any]:
    """Where training stands and what produced it (``config``: ``trainer.args`` as a dict)."""
    args = trainer.args
    return {
        "step": trainer.global_step,
        "epoch": trainer.epoch,
        "step_in_epoch": trainer.step_in_epoch,
        "samples_seen": trainer.samples_seen,
        "world_size": trainer.dist.world_size,
        # The data position: step k of epoch e takes positions [k*G, (k+1)*G) of an
        # order that depends only on (dataset length, seed, e).
        "data": {"seed": args.seed, "epoch": trainer.epoch,
                 "step_in_epoch": trainer.step_in_epoch,
                 "global_batch": trainer.plan.global_batch,
                 "num_samples": trainer.num_train_samples, "shuffle": args.shuffle},
        "validated_at_step": state["counters"]["last_val_step"] == trainer.global_step,
        "best": ({"metric": callback.args.best_metric, "mode": callback.args.best_mode,
                  "value": callback.best_value, "step": callback.best_step}
                 if callback.args.best_metric else None),
        "sailfin_version": __version__,
        "torch_version": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": config if config is not None else dataclasses.asdict(args),
        # The module: and data: sections, when known: a resume compares them.
        "recipe": recipe_spec(trainer),
    }
