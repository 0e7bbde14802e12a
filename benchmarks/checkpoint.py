"""Checkpoint costs: the training stall per save (sync vs async), and resume time at the
start vs the end of an epoch.

1. Stall. An MLP of about 12.6 M parameters (50 MB in fp32, plus 50 MB of SGD
   momentum) trains with a save every few steps, once with ``async_save: false``
   and once with ``true``, interleaved (A B, B A, ...). The stall of a save is the
   time training waits for it (``CheckpointCallback.stall_seconds``): the whole
   write for a sync save; the copy to CPU memory (plus any wait for the previous
   save) for an async one. The figure is the median over rounds of the per-round
   ratio (median async stall / median sync stall of that round). A third arm
   trains without saves in the same rounds: (run time - the no-save run's) /
   saves is a save's true cost, whatever it does in the background (a
   background write still takes CPU and memory bandwidth from training). Every
   clock starts after ``Trainer.setup()``. A fourth arm takes a memory snapshot
   (``trainer.checkpoint.memory.every_n_steps: 1``, in /dev/shm) every step and
   saves nothing to disk: its stall per step, as a share of the no-save step.
   Then ``memory_snapshots.py``: step time with a snapshot every step over step
   time without, like for like under sp and 2-process ddp, and the node's
   /dev/shm bytes per snapshot against one rank's state.

2. Resume. A 100k-sample epoch of 6250 steps is checkpointed after its first
   step and before its last; a fresh trainer resumes from each in turn
   (interleaved). Measured: ``setup()`` (build, load the checkpoint, restore
   every piece and the data position) and the time to the end of the first
   resumed step. sailfin jumps to the saved data position, so the restore costs
   the same at both points; the ratios end/start are printed next to what
   replaying the skipped batches through the data loader would have cost. (The
   first step includes planning the rest of the epoch's sample order, which is
   less work near its end: a resume never costs more than starting an epoch.)

    python benchmarks/checkpoint.py [--rounds 5] [--threads 1] [--no-resume] [--no-memory]
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import add_load_options, interleave, spread, start, summary  # noqa: E402

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


def stall_run(out_dir: str, mode: str, steps: int, every: int) -> tuple[list[float], float]:
    """mode: "sync", "async", "none" (no saves) or "memory" (a memory snapshot every step,
    no disk saves). Returns (stall per save or snapshot, run seconds)."""
    module = Recipe(Data(steps * 8, BIG[0]), BIG)
    saves = mode in ("sync", "async")
    memory = {"every_n_steps": 1} if mode == "memory" else {}
    args = TrainerArguments(epochs=1, train_batch_size=8, output_dir=out_dir, writers=[],
                            val_every_n_epochs=0, log_every_n_steps=1000, resume="never",
                            checkpoint=CheckpointArguments(every_n_steps=every if saves else None,
                                                           at_epoch_end=False, keep_last=1,
                                                           async_save=mode == "async",
                                                           memory=memory))
    trainer = Trainer(module, args)
    trainer.setup()
    begin = time.perf_counter()
    trainer.train()   # ends when the last save is on disk
    total = time.perf_counter() - begin
    saver = next((c for c in trainer.callbacks if hasattr(c, "stall_seconds")), None)
    return (saver.stall_seconds if saver else []), total


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
    parser.add_argument("--no-resume", action="store_true", help="only the stall figures")
    parser.add_argument("--no-memory", action="store_true",
                        help="leave out the arm with a memory snapshot every step")
    add_load_options(parser)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    load = start(opts, "checkpoint.py")
    params = sum(a * b + b for a, b in zip(BIG, BIG[1:]))
    saves = opts.steps // opts.every
    sink = io.StringIO()
    with tempfile.TemporaryDirectory() as tmp:
        stalls: dict[str, list[float]] = {"sync": [], "async": []}
        firsts: dict[str, list[float]] = {"sync": [], "async": []}  # no previous save to wait for

        def arm(mode):
            def run(i):
                with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                    stall, total = stall_run(os.path.join(tmp, f"stall-{i}-{mode}"), mode,
                                             opts.steps, opts.every)
                if mode in stalls and i:
                    stalls[mode] += stall
                    firsts[mode].append(stall[0])
                return (statistics.median(stall) if stall else 0.0), total
            return run

        stalls["memory"], firsts["memory"] = [], []
        modes = ("sync", "async", "none") + (() if opts.no_memory else ("memory",))
        rounds = interleave(opts.rounds, {m: arm(m) for m in modes})
        per_round = [r["async"][0] / r["sync"][0] for r in rounds]
        cost = {m: [(r[m][1] - r["none"][1]) / saves for r in rounds] for m in ("sync", "async")}
        memory_stall = stalls.pop("memory")
        print(f"model: {params / 1e6:.1f} M parameters ({params * 4 / 2**20:.0f} MB, "
              f"checkpoint ~{params * 8 / 2**20:.0f} MB with SGD momentum); a save every "
              f"{opts.every} steps ({saves} per run), {opts.rounds} rounds, "
              f"{opts.threads} thread(s)")
        for mode in stalls:
            values = [x * 1000 for x in stalls[mode]]
            print(f"stall per save, {mode:>5}: median {statistics.median(values):8.1f} ms "
                  f"(min {min(values):.1f}, max {max(values):.1f}, n={len(values)}); true cost "
                  f"per save (run time over the no-save run): median "
                  f"{statistics.median(cost[mode]) * 1000:.1f} ms; first save of a run (no "
                  f"wait for a previous one): {statistics.median(firsts[mode]) * 1000:.1f} ms")
        if memory_stall:
            step = statistics.median(r["none"][1] for r in rounds) / opts.steps
            extra = [(r["memory"][1] - r["none"][1]) / opts.steps for r in rounds]
            print(f"memory snapshot every step: stall median "
                  f"{statistics.median(memory_stall) * 1000:.1f} ms per step = "
                  f"{statistics.median(memory_stall) / step * 100:.1f} % of a {step * 1000:.0f} "
                  f"ms step (n={len(memory_stall)}); true cost per step (run time over the "
                  f"no-save run): median {statistics.median(extra) * 1000:.1f} ms = "
                  f"{statistics.median(extra) / step * 100:.1f} %")
        true_ratio = [a / s for a, s in zip(cost["async"], cost["sync"])]
        print(f"async / sync stall, per round: {spread(per_round)}")
        print(f"async / sync true cost per save, per round: {spread(true_ratio)}")
        if not opts.no_memory:  # like for like: sp and 2-process ddp, and the node's bytes
            import memory_snapshots

            print()
            memory_snapshots.measure(opts.rounds, memory_snapshots.STEPS, opts.threads, load)
        summary("checkpoint.py", "async / sync stall per save (per-round)", per_round, load,
                opts.threads, extra=f"true cost per save async / sync "
                f"{statistics.median(true_ratio):.3f} "
                f"({statistics.median(cost['async']) * 1000:.0f} vs "
                f"{statistics.median(cost['sync']) * 1000:.0f} ms)")
        if opts.no_resume:
            return

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
