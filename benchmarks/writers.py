"""What writers and the progress display cost per training step.

The tiny MLP of overhead.py (64 -> 256 -> 256 -> 10, batch 32, SGD; about the
cheapest step there is, so any per-step cost shows) trains with:

    none     no writers, no progress display
    default  stdout + jsonl writers, plain progress lines (what a CI log gets)
    bar      stdout + jsonl writers, the tqdm progress bar (redrawn to /dev/null)
    all      jsonl + csv + tensorboard + mlflow writers, progress lines

Variants run interleaved in rounds (order reversed every other round) and the
figure is the median over rounds of (variant steps/s) / (none steps/s), from
the trainer's own train_seconds (the loop only: start-up such as MLflow
creating its database is reported separately). 1.00 means free.

Whole-run ratios on a shared machine are noisy, so the script also times each
piece alone in a tight loop: microseconds per ``log_metrics`` call of each
writer and per ``on_step_end`` of the progress display, and what that costs a
step at the chosen logging interval.

    python benchmarks/writers.py [--rounds 5] [--steps 2000] [--log-every 10]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from _measure import add_load_options, start, summary  # noqa: E402

from overhead import BATCH, Data, Recipe, make_data  # noqa: E402

from sailfin import Trainer, TrainerArguments  # noqa: E402
from sailfin.logging import build_writers  # noqa: E402
from sailfin.trainer.features.progress import Progress  # noqa: E402

VARIANTS = {
    "none": dict(writers=[], progress="none"),
    "default": dict(writers=["stdout", "jsonl"], progress="lines"),
    "bar": dict(writers=["stdout", "jsonl"], progress="none"),  # + a bar passed below
    "all": dict(writers=["jsonl", "csv", "tensorboard", "mlflow"], progress="lines"),
}


def run(name: str, ds, out_dir: str, log_every: int, devnull) -> tuple[float, float]:
    """(steps per second of the loop, seconds of start-up and close)."""
    args = TrainerArguments(epochs=1, train_batch_size=BATCH, log_every_n_steps=log_every,
                            output_dir=out_dir, val_every_n_epochs=0, **VARIANTS[name])
    callbacks = [Progress("bar", bar_stream=devnull)] if name == "bar" else []
    start = time.perf_counter()
    summary = Trainer(Recipe(Data(ds)), args, callbacks=callbacks).train()
    total = time.perf_counter() - start
    return summary["global_step"] / summary["train_seconds"], total - summary["train_seconds"]


class _FakeTrainer:
    """What the progress display reads from a trainer."""

    class args:  # noqa: N801 - a stand-in namespace
        epochs, max_steps, train_batch_size = 1, None, BATCH

    class dist:  # noqa: N801
        world_size = 1

    def __init__(self, steps: int) -> None:
        self.steps_per_epoch, self.global_step, self.samples_seen, self.epoch = steps, 0, 0, 0
        self.train_seconds = 0.0


def per_call_costs(calls: int, tmp: str, devnull) -> dict[str, float]:
    """Microseconds per call of each writer's log_metrics and each progress on_step_end."""
    metrics = {"loss": 0.5, "lr": 1e-3, "samples_per_second": 12345.6}
    costs = {}
    for name in ["stdout", "jsonl", "csv", "tensorboard", "mlflow"]:
        with contextlib.redirect_stdout(devnull), contextlib.redirect_stderr(devnull):
            writers = build_writers([name], os.path.join(tmp, f"calls-{name}"))
            start = time.perf_counter()
            for step in range(calls):
                writers.log_metrics(metrics, step, 0, "train")
            costs[f"{name}.log_metrics"] = (time.perf_counter() - start) / calls * 1e6
            writers.close()
    for mode in ["lines", "bar"]:
        progress = Progress(mode, interval=30.0, bar_stream=devnull, line_stream=devnull)
        trainer = _FakeTrainer(calls * 10)
        progress.on_train_start(trainer)
        start = time.perf_counter()
        for _ in range(calls * 10):
            trainer.global_step += 1
            progress.on_step_end(trainer)
        costs[f"progress {mode}.on_step_end"] = (time.perf_counter() - start) / (
            calls * 10) * 1e6
        start = time.perf_counter()
        for step in range(calls):
            progress.log_metrics(metrics, step, 0, "train")
        costs[f"progress {mode}.log_metrics"] = (time.perf_counter() - start) / calls * 1e6
        progress.close()
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    add_load_options(parser)
    opts = parser.parse_args()
    load = start(opts, "writers.py")
    torch.set_num_threads(opts.threads)
    warnings.simplefilter("ignore")
    ds = make_data(opts.steps)
    names = ["none"] + [n for n in opts.variants if n != "none"]
    ratios: dict[str, list[float]] = {n: [] for n in names if n != "none"}
    startup: dict[str, list[float]] = {n: [] for n in names}
    base_rates = []
    with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as devnull:
        for i in range(opts.rounds + 1):  # round 0 warms up imports and caches
            order = names if i % 2 == 0 else names[::-1]
            rates = {}
            for name in order:
                gc.collect()
                with contextlib.redirect_stdout(devnull), contextlib.redirect_stderr(devnull):
                    rates[name], setup = run(name, ds, os.path.join(tmp, f"{name}{i}"),
                                             opts.log_every, devnull)
                if i:
                    startup[name].append(setup)
            if i == 0:
                continue
            base_rates.append(rates["none"])
            for name in ratios:
                ratios[name].append(rates[name] / rates["none"])
            print(f"round {i}: none {rates['none']:7.1f} steps/s | " + " | ".join(
                f"{n} {ratios[n][-1]:.3f}" for n in ratios), flush=True)
    with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as devnull:
        costs = [per_call_costs(2000, tmp, devnull) for _ in range(3)]
    step_us = 1e6 / statistics.median(base_rates)
    print(f"\nper call, median of 3 x 2000 calls (a step of the loop above: {step_us:.0f} us):")
    for key in costs[0]:
        us = statistics.median(c[key] for c in costs)
        per_step = us if "on_step_end" in key else us / opts.log_every
        print(f"  {key:<32} {us:8.2f} us -> {per_step:6.2f} us per step "
              f"({100 * per_step / step_us:.3f}% of a step)")
    print(f"\nno writers: median {statistics.median(base_rates):.1f} steps/s ({opts.steps} "
          f"steps of batch {BATCH}, logging every {opts.log_every} steps, "
          f"{opts.threads} thread(s))")
    for name, values in ratios.items():
        print(f"{name:>8}: median speed relative to no writers = {statistics.median(values):.3f}"
              f" (min {min(values):.3f}, max {max(values):.3f}); start-up + close "
              f"{statistics.median(startup[name]):.2f} s (none: "
              f"{statistics.median(startup['none']):.2f} s)")
    if "default" in ratios:
        summary("writers.py", "default writers / no writers steps/s (per-round)",
                ratios["default"], load, opts.threads, extra="; ".join(
                    f"{n} {statistics.median(v):.3f}" for n, v in ratios.items()
                    if n != "default"))


if __name__ == "__main__":
    main()
