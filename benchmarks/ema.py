"""The cost of ``trainer.ema`` per update: one fused lerp over every parameter.

For MLPs of several sizes it times ``WeightAverage.update()`` against the
optimizer step it follows (SGD with momentum, and AdamW, on the same
parameters), on the CPU or ``--device cuda``. An update reads the weights and
the average and writes the average: about 3 x 4 bytes per fp32 parameter,
so its time is set by memory bandwidth; the figure printed beside it is the
bandwidth it reached.

    python benchmarks/ema.py [--device cpu] [--threads 1] [--repeats 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sailfin.config import EmaArguments  # noqa: E402
from sailfin.trainer.features.ema import WeightAverage  # noqa: E402


def model(width: int, layers: int = 4) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds per call."""
    times = []
    for _ in range(repeats + 3):  # 3 warm-up calls
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 512, 1024, 2048])
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    device = torch.device(opts.device)
    print(f"device {device}, {opts.threads} thread(s); median of {opts.repeats} calls")
    print(f"{'parameters':>12} | {'EMA update':>12} | {'GB/s':>6} | {'SGD step':>12} | "
          f"{'AdamW step':>12}")
    for width in opts.widths:
        net = model(width).to(device)
        for p in net.parameters():
            p.grad = torch.randn_like(p)
        n = sum(p.numel() for p in net.parameters())
        ema = WeightAverage(net, EmaArguments(decay=0.999))
        sgd = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9, foreach=True)
        adamw = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=True)
        t_ema = timed(ema.update, device, opts.repeats)
        t_sgd = timed(sgd.step, device, opts.repeats)
        t_adam = timed(adamw.step, device, opts.repeats)
        gbs = 3 * 4 * n / t_ema / 1e9
        print(f"{n:>12,} | {t_ema * 1e6:>9.1f} us | {gbs:>6.1f} | {t_sgd * 1e6:>9.1f} us | "
              f"{t_adam * 1e6:>9.1f} us")


if __name__ == "__main__":
    main()
