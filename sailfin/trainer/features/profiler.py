"""``trainer.profile_steps: [start, end]``: a torch profiler trace of those steps."""

from __future__ import annotations

import os
import sys
from typing import IO, TYPE_CHECKING, Any, Optional

from ..core.callbacks import Callback

if TYPE_CHECKING:
    from ..core.view import RunView

TOP_OPERATORS = 15


class StepProfiler(Callback):
    """Records optimizer steps ``start`` to ``end`` (counted from 1, inclusive) with
    :mod:`torch.profiler` (the step before runs as its warm-up; validation inside the
    range is recorded too), then writes ``<out_dir>/trace_rank<R>.json`` (Perfetto,
    ``chrome://tracing``) and ``top_ops_rank<R>.txt`` on every rank, and prints the top
    operators on rank 0.

    Example::

        Trainer(module, args, callbacks=[StepProfiler(5, 8, "outputs/run1/profile")]).train()
    """

    def __init__(self, start: int, end: int, out_dir: str, rank: int = 0,
                 stream: Optional[IO[str]] = None) -> None:
        if not 1 <= start <= end:
            raise ValueError(f"need 1 <= start <= end, got [{start}, {end}]")
        self.start, self.end, self.out_dir, self.rank = start, end, out_dir, rank
        self.stream, self.cuda = stream, False
        self.trace_path = os.path.join(out_dir, f"trace_rank{rank}.json")
        self.table_path = os.path.join(out_dir, f"top_ops_rank{rank}.txt")
        self._prof: Any = None
        self.recorded_steps = 0
        self.done = False

    def on_train_start(self, trainer: "RunView") -> None:
        os.makedirs(self.out_dir, exist_ok=True)  # fail now, not after the steps ran
        self.cuda = trainer.device.type == "cuda"
        if trainer.global_step + 2 >= self.start and trainer.global_step < self.end:
            self._begin(trainer.global_step + 1)  # warm-up (or first recorded) step is next

    def on_step_end(self, trainer: "RunView") -> None:
        step = trainer.global_step  # the step that just finished
        if self._prof is not None:
            if step >= self.start:
                self.recorded_steps += 1
            if step >= self.end:
                self._finish(trainer)
            else:
                self._prof.step()  # closes this step's mark, opens the next
        elif not self.done and step + 2 == self.start:
            self._begin(step + 1)

    def on_train_end(self, trainer: "RunView") -> None:
        if self._prof is not None:  # the run ended inside the range
            self._finish(trainer)

    def _begin(self, next_step: int) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU]
        if self.cuda:
            activities.append(ProfilerActivity.CUDA)
        warmup = 1 if next_step < self.start else 0
        active = self.end - max(next_step, self.start) + 1
        self._prof = profile(activities=activities, record_shapes=True,
                             schedule=schedule(wait=0, warmup=warmup, active=active, repeat=1))
        self._prof.start()

    def _finish(self, trainer: "RunView") -> None:
        prof, self._prof = self._prof, None
        prof.stop()
        self.done = True
        sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=TOP_OPERATORS)
        prof.export_chrome_trace(self.trace_path)
        with open(self.table_path, "w", encoding="utf-8") as fh:
            fh.write(table + "\n")
        if self.rank == 0:
            out = self.stream or sys.stdout
            last = self.start + self.recorded_steps - 1
            out.write(f"[profile] steps {self.start}-{last}: trace {self.trace_path}\n"
                      f"[profile] top operators by self time:\n{table}\n")
            out.flush()
