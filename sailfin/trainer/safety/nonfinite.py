"""What a NaN or infinite loss does to a run (``trainer.on_nonfinite``).

* ``stop`` (default): the run ends with :class:`NonFiniteLossError`, naming the step,
  its epoch and the dataset indices of its samples.
* ``skip``: the step's gradients are dropped (no optimizer or scheduler step; its
  samples count as consumed). Counted and logged.
* ``warn``: a warning, counted and logged; the step runs as usual.

Cost. On one CPU process the loss is read each step (no device sync) and ``stop`` ends
the run before the bad step touches the weights. On an accelerator or across processes,
``stop`` and ``warn`` keep the losses on the device and read them where the loop syncs
anyway (each log line, epoch end, before a checkpoint): the step named is still exact,
but later steps have been applied. ``skip`` must know before the optimizer step: one
sync per step (and, across processes, one small all-reduce, so all ranks skip alike)."""

from __future__ import annotations

import math
import warnings
from typing import Callable, Optional

import torch


class NonFiniteLossError(RuntimeError):
    """A step's loss was NaN or infinite and ``trainer.on_nonfinite`` is ``stop``."""

    def __init__(self, message: str, global_step: int, epoch: int, step_in_epoch: int,
                 sample_indices: Optional[list[int]]) -> None:
        super().__init__(message)
        self.global_step = global_step
        self.epoch = epoch
        self.step_in_epoch = step_in_epoch
        self.sample_indices = sample_indices


class NonFiniteLossWarning(RuntimeWarning):
    """A step's loss was NaN or infinite (``on_nonfinite: warn`` or ``skip``)."""


SampleLookup = Callable[[int, int], list[int]]  # (epoch, step in epoch) -> dataset indices


class NonFiniteGuard:
    """Watches each step's loss for the trainer: ``observe`` each step (False: skip its
    optimizer step), ``check`` at the loop's sync points."""

    def __init__(self, policy: str, device: torch.device, world_size: int = 1,
                 reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
                 samples: Optional[SampleLookup] = None, defer: Optional[bool] = None) -> None:
        if policy not in ("stop", "skip", "warn"):
            raise ValueError(f"on_nonfinite must be stop, skip or warn, got {policy!r}")
        self.policy = policy
        self.count = 0  # non-finite steps seen so far
        self._world_size = world_size
        self._reduce = reduce
        self._samples = samples
        if defer is None:  # reading a CPU loss in one process costs no sync
            defer = policy != "skip" and (device.type != "cpu" or world_size > 1)
        if defer and policy == "skip":
            raise ValueError("on_nonfinite=skip must read each loss before the optimizer step")
        self.deferred = defer
        self._pending: list[torch.Tensor] = []
        self._finite: Optional[torch.Tensor] = None  # all_finite of pending[:_read]
        self._read = 0
        self._first: tuple[int, int, int] = (0, 0, 0)  # global step, epoch, step of pending[0]
        self.observe = (self._observe_deferred if defer else
                        self._observe_now if world_size > 1 else self._observe_local)

    # -- per step ---------------------------------------------------------------------
    def _observe_now(self, loss: torch.Tensor, global_step: int, epoch: int, step: int) -> bool:
        """True: go on with the optimizer step; False: skip it. Several processes: every
        rank must take the same decision, so the losses are reduced first."""
        value = self._reduce(loss.detach().clone()).item()
        return math.isfinite(value) or self._found(value, global_step, epoch, step, False)

    def _observe_local(self, loss: torch.Tensor, global_step: int, epoch: int,
                       step: int) -> bool:
        """One process: this rank's own loss decides (no collective)."""
        value = loss.item()
        return math.isfinite(value) or self._found(value, global_step, epoch, step, False)

    def _observe_deferred(self, loss: torch.Tensor, global_step: int, epoch: int,
                          step: int) -> bool:
        if not self._pending:
            self._first = (global_step, epoch, step)
        self._pending.append(loss.detach())  # no kernel, no sync: read in check()
        return True

    def all_finite(self) -> Optional[torch.Tensor]:
        """Whether this rank's losses not read yet are all finite, as a 0-dim tensor on
        their device, for ``stop`` (None: none pending, or another policy): no sync and no
        collective. A memory snapshot holds it and commits only if it reads true; the
        losses stay for :meth:`check`, which names the step."""
        if self.policy != "stop" or not self._pending:
            return None
        new = self._pending[self._read:]  # each loss once: a snapshot every step stays O(1)
        if new:
            flag = torch.stack([t.float().reshape(()) for t in new]).isfinite().all()
            self._finite = flag if self._finite is None else self._finite & flag
            self._read = len(self._pending)
        return self._finite

    # -- at sync points ----------------------------------------------------------------
    def check(self) -> None:
        """Read the losses observed since the last check (a deferred guard only)."""
        if not self._pending:
            return
        losses = torch.stack([t.float().reshape(()) for t in self._pending])
        self._pending, self._finite, self._read = [], None, 0
        if self._world_size > 1:
            losses = self._reduce(losses)  # NaN or inf anywhere stays non-finite in the mean
        values = losses.tolist()
        global_step, epoch, step = self._first
        for i, value in enumerate(values):
            if not math.isfinite(value):
                self._found(value, global_step + i, epoch, step + i,
                            applied=True, steps_after=len(values) - i - 1)

    def _found(self, value: float, global_step: int, epoch: int, step: int, applied: bool,
               steps_after: int = 0) -> bool:
        """Raise (stop) or warn; True: the step goes on (warn), False: skip it."""
        self.count += 1
        where = (f"the loss of train_step at global_step={global_step} (step {step + 1} of "
                 f"epoch {epoch + 1}) is {value}")
        indices = self._samples(epoch, step) if self._samples is not None else None
        if self.policy == "stop":
            if indices is None:
                samples = "the step's samples are not known for this data source"
            else:
                shown = ", ".join(map(str, indices[:32]))
                more = f", ... ({len(indices)} in all)" if len(indices) > 32 else ""
                samples = f"its samples are dataset indices [{shown}{more}]"
            if applied:
                state = (f"the weights were updated by that step and {steps_after} after it: "
                         "do not keep them")
            else:
                state = "the weights are as they were before that step"
            raise NonFiniteLossError(
                f"{where}; {samples}; {state}. Set trainer.on_nonfinite to skip (drop such "
                "steps) or warn (carry on) if these steps are expected.",
                global_step, epoch, step, indices)
        action = "skipped that step" if self.policy == "skip" else "carrying on"
        warnings.warn(f"{where}; {action} (on_nonfinite={self.policy}; {self.count} so far)",
                      NonFiniteLossWarning, stacklevel=3)
        return self.policy == "warn"
