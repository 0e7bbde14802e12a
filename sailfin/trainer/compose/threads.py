"""The thread count the CPU math uses, fixed for the run: float sums split across threads
add in another order when the count changes, so bit-identical results (a resume, an
observer on or off, docs/robustness.md) need one count from the first step to the last.

``torch.set_num_threads`` with the count in effect (the backend's choice, OMP_NUM_THREADS
or torch's default) pins it for torch's own kernels, oneDNN and MKL, and turns MKL's
dynamic choice off (``MKL_DYNAMIC``: MKL may otherwise run on fewer threads than asked).
OpenMP's own dynamic adjustment (``OMP_DYNAMIC=true``) sizes each parallel region by the
machine's load; no public call turns it off, so the run says so.
"""

from __future__ import annotations

import os

import torch

from ...utils.voice import say

_TRUE = ("1", "true", "yes", "on")


def fix_math_threads(device: torch.device, is_main: bool) -> int:
    """Pin the CPU math's thread count (a run on the CPU); return it."""
    threads = torch.get_num_threads()
    if device.type != "cpu":
        return threads
    torch.set_num_threads(threads)  # also mkl_set_dynamic(0), inside torch
    if is_main and os.environ.get("OMP_DYNAMIC", "").strip().lower() in _TRUE:
        say(f"OMP_DYNAMIC={os.environ['OMP_DYNAMIC']}: OpenMP may run each parallel region "
            f"on fewer than {threads} thread(s) while the machine is busy, which changes the "
            "order of float sums: identical runs (a resume, snapshots on or off) may then "
            "differ in the last bits; unset OMP_DYNAMIC (or set it to false) for bit-identical "
            "results", warning=True)
    return threads
