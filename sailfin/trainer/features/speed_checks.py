"""Is a speed setting paying on this machine? Measured once, said in the log:
``torch.compile`` against eager steps (:class:`CompileCheck`, docs/backends.md), and bf16
autocast on a CPU that may emulate bf16, an order of magnitude slower than fp32 there
(:class:`Bf16CpuCheck`: it warns only when a bf16 matmul measured slower)."""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import TYPE_CHECKING, Callable, Optional

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


class EagerStance(contextlib.ExitStack):
    """``stance(True)`` runs compiled code eagerly from now on; ``stance(False)`` puts back
    the stance that was in force before (the application's own, if it set one)."""

    def __call__(self, eager: bool) -> None:
        if eager:
            self.enter_context(torch.compiler.set_stance("force_eager"))
        else:
            self.close()


class CompileCheck(Callback):
    """Times compiled against eager training steps once, and warns when compiling loses.

    Steps ``(warmup, warmup + w]`` and ``(warmup + 2w, warmup + 3w]`` run compiled,
    ``(warmup + w, warmup + 2w]`` eagerly (global step numbers, so a resumed run
    does the same). The trainer adds it with ``trainer.compile`` on."""

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


# -- bf16 autocast on a CPU that emulates bf16 ----------------------------------------
#: Capabilities with native bf16 matrix instructions.
NATIVE_BF16 = ("AVX512_BF16", "AMX")
#: The same, as /proc/cpuinfo names them.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags as the kernel lists them (empty where there is no such file)."""
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def native_bf16(capability: Optional[str] = None,
                flags: Optional[frozenset[str]] = None) -> bool:
    """Whether the CPU has native bf16 matmuls: the capability torch reports, or the
    kernel's flags (torch reports AVX512 on a CPU that has AVX512_BF16 as well)."""
    capability = capability or torch.backends.cpu.get_cpu_capability()
    flags = cpu_flags() if flags is None else flags
    return (any(name in capability.upper() for name in NATIVE_BF16)
            or any(flag in flags for flag in NATIVE_BF16_FLAGS))


def bf16_cost(size: int = 256, repeats: int = 3) -> float:
    """Seconds of one bf16 autocast matmul over one fp32 matmul (best of ``repeats``)."""
    a, b = torch.randn(size, size), torch.randn(size, size)

    def best(autocast: bool) -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                a @ b
            times.append(time.perf_counter() - started)
        return min(times)

    with torch.random.fork_rng():
        best(True)  # warm-up
        return best(True) / max(best(False), 1e-9)


class Bf16CpuCheck(Callback):
    """Warns once, at the start, when bf16 autocast runs on a CPU that emulates bf16."""

    def __init__(self) -> None:
        self.message: Optional[str] = None

    def on_train_start(self, trainer: "RunView") -> None:
        capability = torch.backends.cpu.get_cpu_capability()
        if native_bf16(capability):
            return
        ratio = bf16_cost()
        if ratio <= 1.0:  # measured no slower: nothing to advise, whatever the flags say
            return
        self.message = (
            f"bf16 autocast on a CPU without native bf16 (torch reports {capability}, "
            "/proc/cpuinfo lists neither avx512_bf16 nor amx_bf16): one bf16 matmul took "
            f"{ratio:.1f}x as long as the fp32 one here; trainer.backend sp (fp32) is likely "
            "faster on this machine")
        if trainer.dist.is_main:
            say(self.message, warning=True)
