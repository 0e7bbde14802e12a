"""DP-SGD's cost and its accounting: ``python benchmarks/dp.py``.

1. Steps/s and peak memory of ``sp-dp`` (flat and ghost clipping) against ``sp`` on the
   same recipe (an MLP on the digits, per-sample losses), each measured in a fresh child
   process per round (peak memory: the child's peak RSS above its RSS before training,
   or CUDA's peak allocation), rounds interleaved; the figure is the median per-round
   ratio to ``sp``.
2. epsilon after one epoch of the digits DP example against Opacus's ``RDPAccountant``
   called directly with the same sampling rate, noise and steps (must agree to 1e-6).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from _measure import add_load_options, interleave, ratios, spread, start, summary  # noqa: E402
from examples.digits.recipe import DigitsClassifier, DigitsData  # noqa: E402
from sailfin import Callback, Trainer, TrainerArguments  # noqa: E402
from sailfin.utils.memory import peak_rss_bytes  # noqa: E402

MODES = {"sp": ("sp", None), "sp-dp flat": ("sp-dp", "flat"), "sp-dp ghost": ("sp-dp", "ghost")}


class PerSample(DigitsClassifier):
    """The digits MLP; under dp its train_step returns per-sample losses (ghost needs them)."""

    per_sample = True

    def train_step(self, global_step, batch, device):
        x, y = batch[0].to(device), batch[1].to(device)
        loss = nn.functional.cross_entropy(self(x), y, reduction="none")
        return loss if self.per_sample else loss.mean()


class Clock(Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.started = warmup, None

    def on_step_end(self, trainer) -> None:
        if trainer.global_step == self.warmup:
            self.started = time.perf_counter()


def child(mode: str, steps: int, hidden: int, batch: int) -> None:
    backend, clipping = MODES[mode]
    torch.manual_seed(0)
    module = PerSample(DigitsData(), hidden=hidden, lr=0.01, dropout=0.0)
    module.per_sample = clipping is not None
    dp = {"noise_multiplier": 1.0, "clipping": clipping} if clipping else {}
    args = TrainerArguments(backend=backend, epochs=100, max_steps=steps, train_batch_size=batch,
                            micro_batch_size=batch, writers=[], progress="none",
                            val_every_n_epochs=0, sanity_val_batches=0, count_flops=False,
                            output_dir=tempfile.mkdtemp(prefix="sailfin-dp-bench-"),
                            resume="never", dp=dp)
    clock = Clock(warmup=5)
    trainer = Trainer(module, args, callbacks=[clock])
    cuda = trainer.backend.device.type == "cuda"
    base = peak_rss_bytes()
    trainer.train()
    rate = (steps - clock.warmup) / (time.perf_counter() - clock.started)
    peak = (torch.cuda.max_memory_allocated() if cuda else
            peak_rss_bytes() - base)
    trainer.close()
    print(json.dumps({"steps_per_second": rate, "peak_bytes": peak}))


def run_child(mode: str, opts: argparse.Namespace) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--steps", str(opts.steps),
                          "--hidden", str(opts.hidden), "--batch", str(opts.batch)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def epsilon_check() -> float:
    from opacus.accountants import RDPAccountant

    data = DigitsData()
    args = TrainerArguments(backend="sp-dp", epochs=1, train_batch_size=64, micro_batch_size=32,
                            writers=[], progress="none", resume="never",
                            output_dir=tempfile.mkdtemp(prefix="sailfin-dp-bench-"),
                            dp={"noise_multiplier": 1.0, "max_grad_norm": 1.0})
    result = Trainer(DigitsClassifier(data, lr=0.01, dropout=0.0), args).train()["privacy"]
    n = len(data.train)
    direct = RDPAccountant()
    direct.history = [(1.0, 64 / n, -(-n // 64))]  # sigma, q, ceil(N / batch) steps
    expected = direct.get_epsilon(delta=1 / n)
    diff = abs(result["epsilon"] - expected)
    print(f"epsilon after one digits epoch: sailfin {result['epsilon']:.9f}, Opacus "
          f"RDPAccountant {expected:.9f}, |diff| {diff:.2e} (steps {result['accounted_steps']}, "
          f"q {64 / n:.5f}, delta 1/{n})")
    if diff > 1e-6:
        raise SystemExit("epsilon disagrees with Opacus's RDPAccountant by more than 1e-6")
    return diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--child", choices=list(MODES))
    add_load_options(parser)
    opts = parser.parse_args()
    if opts.child:
        return child(opts.child, opts.steps, opts.hidden, opts.batch)
    load = start(opts, "dp")
    diff = epsilon_check()
    peaks: dict[str, list[float]] = {m: [] for m in MODES}

    def variant(mode):
        def run(_round: int) -> float:
            figures = run_child(mode, opts)
            peaks[mode].append(figures["peak_bytes"])
            return figures["steps_per_second"]
        return run

    rounds = interleave(opts.rounds, {m: variant(m) for m in MODES}, warmup=0)
    for mode in MODES:
        rates = [r[mode] for r in rounds]
        mib = sorted(peaks[mode])[len(peaks[mode]) // 2] / 2**20
        print(f"{mode:12s} steps/s {spread(rates)}; peak memory (median) {mib:.1f} MiB")
    flat, ghost = ratios(rounds, "sp-dp flat", "sp"), ratios(rounds, "sp-dp ghost", "sp")
    summary("dp", "steps/s of sp-dp flat / sp", flat, load, torch.get_num_threads(),
            extra=f"ghost / sp {spread(ghost)}; epsilon |diff| vs RDPAccountant {diff:.1e}")


if __name__ == "__main__":
    main()
