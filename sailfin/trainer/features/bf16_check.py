"""bf16 autocast on a CPU that emulates bf16: a one-line warning at start-up.

CPUs with native bf16 matrix instructions (AVX512_BF16, AMX) run ``sp-amp`` faster than
fp32; an AVX2-only CPU emulates bf16 and can be an order of magnitude slower (measured
here: one 512x512 bf16 matmul 46 ms against 3.6 ms in fp32). At the start of a run
with bf16 autocast on the CPU, :class:`Bf16CpuCheck` reads the CPU's capability: the
one torch dispatches to (``torch.backends.cpu.get_cpu_capability()``, which says
``AVX512`` on a CPU that also has AVX512_BF16) and the flags in ``/proc/cpuinfo``
(``avx512_bf16``, ``amx_bf16``). Without native bf16 it times one matmul in each
precision, and only when bf16 measured slower it warns with the measured cost and the
advice to use ``sp`` (as the compile check does for compilation that does not pay).
Nothing runs otherwise.

Example::

    Trainer(module, args, callbacks=[Bf16CpuCheck()])   # added for sp-amp/ddp-amp on CPU
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

import torch

from ...utils.voice import say
from ..core.callbacks import Callback

if TYPE_CHECKING:
    from ..core.view import RunView

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


def bf16_cpu_check(backend: object) -> Optional[Bf16CpuCheck]:
    """The check when ``backend`` autocasts to bf16 on the CPU, else None."""
    precision = getattr(backend, "precision", None)
    device = getattr(backend, "device", None)
    if getattr(precision, "name", None) == "bf16" and getattr(device, "type", None) == "cpu":
        return Bf16CpuCheck()
    return None
