"""Checkpoint costs: the training stall per save (sync vs async), and resume time at the
start vs the end of an epoch.

1. Stall. An MLP of about 12.6 M parameters (50 MB in fp32, plus 50 MB of SGD
   momentum) trains with a save every few steps, once with ``async_save: false``
   and once with ``true``, interleaved (A B, B A, ...). The stall of a save is the
   time training waits for it (``CheckpointCallback.stall_seconds``): the whole
   write for a sync save; the copy to CPU memory (plus any wait for the previous
   save) for an async one. The figure is the ratio of the medians.

2. Resume. A 100k-sample epoch of 6250 steps is checkpointed after its first
   step and before its last; a fresh trainer resumes from each in turn
   (interleaved). Measured: ``setup()`` (build, load the checkpoint, restore
   every piece and the data position) and the time to the end of the first
   resumed step. sailfin jumps to the saved data position, so the restore costs
   the same at both points; the ratios end/start are printed next to what
   replaying the skipped batches through the data loader would have cost. (The
   first step includes planning the rest of the epoch's sample order, which is
   less work near its end: a resume never costs more than starting an epoch.)

    python benchmarks/checkpoint.py [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sailfin import Callback, DataInterface, ModuleInterface, Trainer, TrainerArguments  # noqa
from sailfin.config import CheckpointArguments  # noqa: E402


class Data(DataInterface):
    def __init__(self, n: int, dim: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ds = torch.utils.data.TensorDataset(torch.randn(n, dim, generator=g),
                                                 torch.randint(0, 10, (n,), generator=g))

    def get_train_dataset(self):
        return self.ds


class Recipe(ModuleInterface):
    def __init__(self, data: Data, dims: list[int]) -> None:
        super().__init__()
        self.data = data
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for a, b in zip(dims, dims[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*layers[:-1])

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)], []

    def train_step(self, global_step, batch, device):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x.to(device)), y.to(device))


# -- 1. the stall per save ------------------------------------------------------------------
BIG = [1024, 2048, 2048, 2048, 1024, 10]   # 12.6 M parameters


def stall_run(out_dir: str, async_save: bool, steps: int, every: int) -> tuple[list[float], float]:
    module = Recipe(Data(steps * 8, BIG[0]), BIG)
    args = TrainerArguments(epochs=1, train_batch_size=8, output_dir=out_dir, writers=[],
                            val_every_n_epochs=0, log_every_n_steps=1000, resume="never",
                            checkpoint=CheckpointArguments(every_n_steps=every,
                                                           at_epoch_end=False, keep_last=1,
                                                           async_save=async_save))
    trainer = Trainer(module, args)
    start = time.perf_counter()
    trainer.train()   # ends when the last save is on disk
    total = time.perf_counter() - start
    saver = next(c for c in trainer.callbacks if hasattr(c, "stall_seconds"))
    return saver.stall_seconds, total


# -- 2. resume at the start vs the end of an epoch ----------------------------------------------
SMALL = [16, 32, 10]
N_SAMPLES, BATCH = 100_000, 16           # 6250 steps per epoch


class FirstStep(Callback):
    """Records when the first resumed step ends, then stops the run."""

    def __init__(self) -> None:
        self.at: float = 0.0

    def on_step_end(self, trainer):
        self.at = time.perf_counter()
        raise StopIteration


def small_args(out_dir: str, **kw) -> TrainerArguments:
    return TrainerArguments(epochs=1, train_batch_size=BATCH, output_dir=out_dir, writers=[],
                            val_every_n_epochs=0, log_every_n_steps=100_000, **kw)


def make_checkpoint(out_dir: str, data: Data, steps: int) -> str:
    Trainer(Recipe(data, SMALL), small_args(out_dir, max_steps=steps)).train()
    return os.path.join(out_dir, "checkpoints", f"step-{steps:08d}")


def resume_time(checkpoint: str, out_dir: str, data: Data) -> tuple[float, float]:
    """Seconds to set up (load and restore) and to the end of the first resumed step."""
    watch = FirstStep()
    start = time.perf_counter()
    trainer = Trainer(Recipe(data, SMALL), small_args(out_dir, resume=checkpoint),
                      callbacks=[watch])
    trainer.setup()
    ready = time.perf_counter()
    with contextlib.suppress(StopIteration):
        trainer.train()
    return ready - start, watch.at - start


def replay_time(data: Data, batches: int) -> float:
    """What skipping ``batches`` by reading them through the loader would cost."""
    loader = torch.utils.data.DataLoader(data.ds, batch_size=BATCH, shuffle=True)
    start = time.perf_counter()
    for i, _ in enumerate(loader):
        if i + 1 == batches:
            break
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=24, help="steps per stall run")
    parser.add_argument("--every", type=int, default=8, help="save every N steps")
    parser.add_argument("--threads", type=int, default=1)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    params = sum(a * b + b for a, b in zip(BIG, BIG[1:]))
    sink = io.StringIO()
    with tempfile.TemporaryDirectory() as tmp:
        stalls: dict[bool, list[float]] = {False: [], True: []}
        totals: dict[bool, list[float]] = {False: [], True: []}
        for i in range(opts.rounds + 1):   # round 0 warms up
            order = [False, True] if i % 2 == 0 else [True, False]
            for async_save in order:
                gc.collect()
                with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                    stall, total = stall_run(os.path.join(tmp, f"stall-{i}-{async_save}"),
                                             async_save, opts.steps, opts.every)
                if i:
                    stalls[async_save] += stall
                    totals[async_save].append(total)
        sync, async_ = statistics.median(stalls[False]), statistics.median(stalls[True])
        print(f"model: {params / 1e6:.1f} M parameters ({params * 4 / 2**20:.0f} MB, "
              f"checkpoint ~{params * 8 / 2**20:.0f} MB with SGD momentum); a save every "
              f"{opts.every} steps, {opts.rounds} rounds")
        print(f"stall per save, sync : median {sync * 1000:8.1f} ms "
              f"(min {min(stalls[False]) * 1000:.1f}, max {max(stalls[False]) * 1000:.1f}, "
              f"n={len(stalls[False])})")
        print(f"stall per save, async: median {async_ * 1000:8.1f} ms "
              f"(min {min(stalls[True]) * 1000:.1f}, max {max(stalls[True]) * 1000:.1f}, "
              f"n={len(stalls[True])})")
        whole = statistics.median(totals[True]) / statistics.median(totals[False])
        print(f"async / sync stall: {async_ / sync:.3f}; whole run (incl. the last write) "
              f"async / sync: {whole:.3f}")

        data = Data(N_SAMPLES, SMALL[0])
        steps = -(-N_SAMPLES // BATCH)
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            early = make_checkpoint(os.path.join(tmp, "early"), data, 1)
            late = make_checkpoint(os.path.join(tmp, "late"), data, steps - 1)
        times: dict[str, list[tuple[float, float]]] = {"start": [], "end": []}
        resume_rounds = 4 * opts.rounds  # each is a few ms: more rounds, steadier medians
        for i in range(resume_rounds + 1):
            order = [("start", early), ("end", late)]
            if i % 2:
                order.reverse()
            for name, path in order:
                gc.collect()
                with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                    seconds = resume_time(path, os.path.join(tmp, f"resume-{i}-{name}"), data)
                if i:
                    times[name].append(seconds)
        print(f"\nresume in an epoch of {steps} steps, after step 1 vs after step {steps - 1} "
              f"(medians of {resume_rounds}):")
        for i, what in enumerate(("setup (load + restore)", "to the end of the first step")):
            start_s = statistics.median(t[i] for t in times["start"])
            end_s = statistics.median(t[i] for t in times["end"])
            print(f"  {what:>28}: {start_s * 1000:7.1f} ms vs {end_s * 1000:7.1f} ms, "
                  f"end / start {end_s / start_s:.3f}")
        print(f"  replaying the {steps - 2} skipped batches through the loader instead would "
              f"take {replay_time(data, steps - 2) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
