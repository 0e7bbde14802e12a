"""Straggler figures at each log line: the slowest and the median rank's step time.

Ranks wait for each other in the gradient all-reduce, so their wall-clock step
times are all the same. What differs is each rank's own work before it can
exchange gradients: loading its data, and its forwards and backwards up to the
step's last backward (on CUDA, the host's part of them: kernels run
asynchronously). The loop adds that "ready time" up per step; at a log line
each rank's mean per step travels in the all-gather that also carries the
loss (the collective the log line makes anyway), and rank 0 logs
``step_time_median``, ``step_time_slowest`` and ``slowest_rank``. A slow disk,
a throttled device or a busy host shows there before it hangs anything.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch


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
