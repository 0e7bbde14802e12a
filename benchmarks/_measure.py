"""What every benchmark here shares: the load check, interleaved rounds, per-round ratios,
and the one summary line a reader (or a script) looks for.

A ratio is taken inside each round (variant / reference measured back to back,
in alternating order), and the figure is the median of those per-round ratios
with their spread: machine noise that hits a round hits both sides of its
ratio. A benchmark refuses to start when the 1-minute load average is above
``--max-load`` (default 0.75 x the CPU count), because a figure measured on a
busy machine says more about the machine than about the code;
``--allow-load`` runs anyway and marks the summary ``LOADED``. The load is
read again at the end and printed beside the figure with the thread count.
Every benchmark names the machine it ran on (:func:`machine`): the CPU model
and ``torch.backends.cpu.get_cpu_capability()`` (a bf16 or int8 figure means
little without them).

    from _measure import add_load_options, start, interleave, summary
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
from typing import Callable, Mapping, Optional, Sequence


def loadavg() -> float:
    """The 1-minute load average (0.0 where the OS does not say)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def cpu_model() -> str:
    """The CPU's model name as ``lscpu`` says it (read from /proc/cpuinfo), else the platform's."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine() -> str:
    """``CPU AMD EPYC, capability AVX2, 2 CPUs, torch 2.13.0``: printed beside every figure."""
    import torch  # here, not at the top: the harness itself needs no torch

    return (f"CPU {cpu_model()}, capability {torch.backends.cpu.get_cpu_capability()}, "
            f"{os.cpu_count()} CPUs, torch {torch.__version__}")


def add_load_options(parser: argparse.ArgumentParser) -> None:
    cpus = os.cpu_count() or 1
    parser.add_argument("--max-load", type=float, default=0.75 * cpus,
                        help="refuse to run when the 1-minute load average is above this "
                             f"(default 0.75 x {cpus} CPUs = {0.75 * cpus:g})")
    parser.add_argument("--allow-load", action="store_true",
                        help="run above --max-load anyway; the summary says LOADED")


class Load:
    """The load before and after a benchmark, and whether it was too high to trust."""

    def __init__(self, max_load: float, allowed: bool) -> None:
        self.max_load = max_load
        self.allowed = allowed
        self.before = loadavg()
        self.after: Optional[float] = None

    def finish(self) -> None:
        self.after = loadavg()

    @property
    def loaded(self) -> bool:
        return max(self.before, self.after or 0.0) > self.max_load

    def describe(self) -> str:
        after = f"{self.after:.2f}" if self.after is not None else "?"
        flag = (f" LOADED (above {self.max_load:g}: re-run on a quiet machine)"
                if self.loaded else f" (threshold {self.max_load:g})")
        return f"load1 {self.before:.2f} -> {after}, {os.cpu_count()} CPUs{flag}"


def start(opts: argparse.Namespace, name: str) -> Load:
    """Check the load before a benchmark: refuse (exit 3) above the threshold unless allowed."""
    load = Load(opts.max_load, opts.allow_load)
    print(f"{name}: {machine()}; load1 {load.before:.2f}", flush=True)
    if load.before > opts.max_load:
        message = (f"{name}: the 1-minute load average is {load.before:.2f}, above "
                   f"--max-load {opts.max_load:g}; other work would be measured too.")
        if not opts.allow_load:
            print(message + " Wait for a quiet machine, or pass --allow-load to run anyway "
                  "(the summary is then marked LOADED).", file=sys.stderr)
            raise SystemExit(3)
        print("WARNING " + message + " Running anyway (--allow-load).", file=sys.stderr,
              flush=True)
    return load


def interleave(rounds: int, variants: Mapping[str, Callable[[int], float]], *,
               warmup: int = 1, on_round: Optional[Callable[[int, dict], None]] = None
               ) -> list[dict[str, float]]:
    """Run every variant once per round, reversing the order every other round; return
    each measured round's values (name -> what the variant's function returned).

    Rounds ``< warmup`` run but are not returned (caches, lazy imports, allocator).
    Each function gets the round number and starts its own clock at the same point
    as the others (the benchmark says which).
    """
    measured = []
    names = list(variants)
    for i in range(warmup + rounds):
        order = names if i % 2 == 0 else names[::-1]
        values = {}
        for name in order:
            gc.collect()
            values[name] = variants[name](i)
        if i >= warmup:
            measured.append(values)
            if on_round is not None:
                on_round(i - warmup + 1, values)
    return measured


def ratios(rounds: Sequence[Mapping[str, float]], variant: str, reference: str
           ) -> list[float]:
    """variant / reference inside each round."""
    return [r[variant] / r[reference] for r in rounds]


def spread(values: Sequence[float]) -> str:
    """``median 1.012 (min 0.981, max 1.040, n=9)``"""
    return (f"median {statistics.median(values):.3f} (min {min(values):.3f}, "
            f"max {max(values):.3f}, n={len(values)})")


def summary(bench: str, what: str, values: Sequence[float], load: Load, threads: object,
            extra: str = "") -> str:
    """The one line to look for: ``SUMMARY <bench>: <what> = median ... | threads | load``."""
    load.finish()
    line = (f"SUMMARY {bench}: {what} = {spread(values)}{'; ' + extra if extra else ''} | "
            f"torch threads {threads} | {load.describe()} | {machine()}")
    print(line, flush=True)
    return line
