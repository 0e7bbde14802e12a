"""Is ``torch.compile`` paying? Measured once per run, said in the log.

Compiling is not always faster: on a small model, or on a CPU, the compiled
step can be slower than the eager one, and the first step pays the
compilation too. With ``trainer.compile`` on, :class:`CompileCheck` times a
few real training steps after warm-up: a window of compiled steps, a window of
the same steps run eagerly (``torch.compiler.set_stance("force_eager")``: the
compiled code is kept, the step runs the original Python), a second compiled
window; the ratio is the eager median over the compiled median. When it is
below ``1.0`` (compiling does not pay) the log says so with the figures, once.

The eager window is real training (nothing is replayed, nothing extra runs):
it is the same global steps in every run, resumed or not, so a resumed run
takes those steps eagerly as well. Eager and compiled steps agree to rounding,
not bit for bit. With ``trainer.compile`` off nothing of this runs.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from ...utils.voice import say
from ..core.callbacks import Callback

if TYPE_CHECKING:
    from ..core.view import RunView

WARMUP_STEPS = 8   # compilation, and a recompilation for a second shape, happen here
WINDOW_STEPS = 4   # steps per window: compiled, eager, compiled


def compile_verdict(compiled: list[float], eager: list[float], first_step: Optional[float]
                    ) -> tuple[bool, str]:
    """(pays, message) from per-step seconds of compiled and eager steps."""
    c, e = statistics.median(compiled), statistics.median(eager)
    speedup = e / c
    first = (f"; the first step (compilation) took {first_step:.1f} s"
             if first_step is not None else "")
    if speedup < 1.0:
        return False, (
            f"torch.compile does not pay on this model and device: a compiled step takes "
            f"{c * 1000:.2f} ms, an eager one {e * 1000:.2f} ms (eager / compiled "
            f"{speedup:.2f}x, medians of {len(compiled)} and {len(eager)} steps){first}. "
            "Train eagerly with trainer.compile: false (--trainer.compile false)")
    payback = ""
    if first_step is not None and e > c:
        payback = f"; the compilation pays for itself after ~{int(first_step / (e - c))} steps"
    return True, (f"torch.compile: a compiled step takes {c * 1000:.2f} ms, an eager one "
                  f"{e * 1000:.2f} ms ({speedup:.2f}x faster){first}{payback}")


class EagerStance:
    """``stance(True)`` runs compiled code eagerly from now on; ``stance(False)`` puts back
    the stance that was in force before (the application's own, if it set one)."""

    def __init__(self) -> None:
        self._context: Optional[Any] = None

    def __call__(self, eager: bool) -> None:
        if eager and self._context is None:
            self._context = torch.compiler.set_stance("force_eager")  # in force at once
        elif not eager and self._context is not None:
            self._context.__exit__(None, None, None)  # the previous stance again
            self._context = None


class CompileCheck(Callback):
    """Times compiled against eager training steps once, and warns when compiling loses.

    Steps ``(warmup, warmup + w]`` and ``(warmup + 2w, warmup + 3w]`` run compiled,
    ``(warmup + w, warmup + 2w]`` eagerly (global step numbers, so a resumed run
    does the same). ``clock`` and ``stance`` are injectable for tests.

    Example::

        Trainer(module, args, callbacks=[CompileCheck()])  # added by itself with compile on
    """

    def __init__(self, warmup: Optional[int] = None, window: Optional[int] = None,
                 clock: Callable[[], float] = time.perf_counter,
                 stance: Optional[Callable[[bool], None]] = None) -> None:
        self.warmup = WARMUP_STEPS if warmup is None else warmup
        self.window = WINDOW_STEPS if window is None else window
        self.clock = clock
        self.stance = stance or EagerStance()
        self.eager = False
        self.times: dict[int, float] = {}  # global step -> when it ended
        self.started: Optional[float] = None
        self.first_step_at: Optional[int] = None
        self.verdict: Optional[tuple[bool, str]] = None

    def _eager_window(self, step: int) -> bool:
        lo = self.warmup + self.window
        return lo < step <= lo + self.window

    def _set(self, eager: bool) -> None:
        if eager != self.eager:
            self.stance(eager)
            self.eager = eager

    def on_train_start(self, trainer: "RunView") -> None:
        self._set(self._eager_window(trainer.global_step + 1))
        self.started = self.clock()
        self.first_step_at = trainer.global_step + 1

    def on_step_end(self, trainer: "RunView") -> None:
        step = trainer.global_step
        end = self.warmup + 3 * self.window
        if self.verdict is None and (step == self.first_step_at or self.warmup <= step <= end):
            if trainer.device.type == "cuda":
                torch.cuda.synchronize(trainer.device)  # time the kernels, not their launch
            self.times[step] = self.clock()
            if step == end:
                self._decide(trainer)
        self._set(self._eager_window(step + 1))

    def on_train_end(self, trainer: "RunView") -> None:
        self._set(False)

    def _decide(self, trainer: "RunView") -> None:
        lo = self.warmup
        if lo not in self.times:  # resumed inside the windows: no whole measurement
            return
        durations = {s: self.times[s] - self.times[s - 1]
                     for s in range(lo + 1, lo + 3 * self.window + 1) if s - 1 in self.times}
        eager = [d for s, d in durations.items() if self._eager_window(s)]
        compiled = [d for s, d in durations.items() if not self._eager_window(s)]
        if not eager or not compiled:
            return
        first = None
        if self.first_step_at == 1 and 1 in self.times and self.started is not None:
            first = self.times[1] - self.started
        self.verdict = compile_verdict(compiled, eager, first)
        if trainer.dist.is_main:
            say(self.verdict[1], warning=not self.verdict[0])
