"""The train log line every ``log_every_n_steps``: loss, lr, throughput, the recipe's stats.

It is the loop's only host-device sync. With several ranks it also carries the
straggler figures (docs/many-processes.md): each rank's own work per step before it can
exchange gradients (its "ready time": data, forwards, backwards up to the step's last
backward) travels in the all-gather that carries the loss; the ranks' wall-clock step
times are all the same, as they wait for each other in the gradient all-reduce."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch

from .view import epoch_number


if TYPE_CHECKING:
    from .trainer import Loop


class TrainLog:
    """The clocks behind the train log line: samples/s since the last line and each
    rank's "ready" time (its own work up to the step's last backward)."""

    def __init__(self) -> None:
        self.ready_seconds = 0.0  # this rank's own work since the last log line
        self.ready_since = 0      # ... which came after this many steps
        self._clock = (time.perf_counter(), 0)

    def restart(self, samples_seen: int) -> None:
        """Measure throughput from now (a new epoch, or a step run again)."""
        self._clock = (time.perf_counter(), samples_seen)

    def exclude(self, seconds: float) -> None:
        """Time spent on something else (validation) is not training throughput."""
        then, seen = self._clock
        self._clock = (then + seconds, seen)

    def write(self, trainer: "Loop", step_loss: torch.Tensor,
              stats: Optional[Mapping[str, Any]]) -> None:
        """Log the train metrics at ``trainer.global_step``."""
        trainer.nonfinite.check()
        now = time.perf_counter()
        then, seen = self._clock
        self._clock = (now, trainer.samples_seen)
        stragglers: dict[str, float] = {}
        backend = trainer.backend
        if trainer.dist.is_distributed:  # each rank's own step time rides with the loss
            loss, stragglers = loss_and_stragglers(backend, step_loss, self.ready_seconds,
                                                   trainer.global_step - self.ready_since)
        else:
            loss = backend.all_reduce_mean(step_loss.detach()).item()
        self.ready_seconds, self.ready_since = 0.0, trainer.global_step
        metrics: dict[str, float] = {"loss": loss,
                                     "lr": trainer.optimizers[0].param_groups[0]["lr"]}
        metrics.update(stragglers)
        if isinstance(stats, Mapping):  # PyMarlin's extra outputs go to the callback
            metrics.update(reduce_stats(stats, backend, trainer.dist.is_distributed))
        if trainer.nonfinite.count:
            metrics["nonfinite_steps"] = trainer.nonfinite.count
        if now > then:
            metrics["samples_per_second"] = (trainer.samples_seen - seen) / (now - then)
            metrics.update(trainer.flops.metrics(metrics["samples_per_second"]))  # tflops, mfu
        # Unreadable samples a dataset skipped (on_error: skip), counted over its workers.
        dataset = getattr(trainer.train_loader, "dataset", None)
        skipped = getattr(dataset, "skipped_samples", 0)
        if skipped:
            metrics["skipped_samples"] = skipped
        trainer.writers.log_metrics(metrics, trainer.global_step,
                                epoch_number(trainer.epoch, trainer.step_in_epoch), "train")


def loss_and_stragglers(backend: Any, step_loss: torch.Tensor, ready_seconds: float,
                        steps: int) -> tuple[float, dict[str, float]]:
    """The loss averaged over ranks, and the straggler metrics (one all-gather)."""
    local = torch.stack([step_loss.detach().float().reshape(()),
                         torch.tensor(ready_seconds / max(1, steps),
                                      device=step_loss.device)])
    rows = backend.gather_scalars(local).cpu()
    times = rows[:, 1].tolist()
    slowest = max(range(len(times)), key=times.__getitem__)
    return rows[:, 0].mean().item(), {"step_time_median": statistics.median(times),
                                      "step_time_slowest": times[slowest],
                                      "slowest_rank": slowest}


def reduce_stats(stats: Mapping[str, Any], backend: Any, distributed: bool) -> dict[str, Any]:
    """The recipe's step stats, averaged over ranks (one all-reduce for all tensors)."""
    tensors = {k: v for k, v in stats.items()
               if isinstance(v, torch.Tensor) and v.numel() == 1}
    out = {k: scalar(v) for k, v in stats.items() if k not in tensors}
    if tensors and distributed:
        stacked = torch.stack([v.detach().float().reshape(()) for v in tensors.values()])
        values = backend.all_reduce_mean(stacked).tolist()
        out.update(zip(tensors, values))
    else:
        out.update({k: v.item() for k, v in tensors.items()})
    return out


def scalar(value: Any) -> Any:
    """A one-element tensor as a number, a larger one as a list, anything else as is."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    return value
