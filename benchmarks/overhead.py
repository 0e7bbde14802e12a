"""The trainer's own overhead per step, as a ratio against a hand-written loop.

The same tiny MLP (64 -> 256 -> 256 -> 10, batch 32, SGD) on the same data is
trained by a plain PyTorch loop (the standard ``DataLoader``, ``shuffle=True``)
and by sailfin's Trainer (default writers and progress), interleaved A B, B A,
... so that machine noise and run order hit both alike.

Two clocks, the same for every variant:

- steady: starts after set-up (model, optimizer and loader built; for sailfin
  ``Trainer.setup()`` done) and stops when the last optimizer step ends;
- end to end: starts before anything is built and stops when the run returns
  (for sailfin: ``Trainer(...).train()`` including its summary and final weights).

The figure is the median over rounds of the per-round ratio
(sailfin steps/s) / (raw steps/s) on the steady clock; 1.00 means no
overhead, above 1.00 sailfin is faster (it gathers each in-memory micro-batch
in one call where the raw loop fetches 32 samples and collates them). The
benchmark refuses to run when the machine is busy (see ``_measure.py``).

When installed (`pip install -e .[bench]`), Lightning's Trainer, Lightning
Fabric and Accelerate run the same model in the same rounds, for comparison
(end-to-end clock only for Lightning's Trainer, whose ``fit`` does its set-up).

``--instructions`` gives a figure that does not depend on the machine's load:
instructions per step of both loops counted by valgrind's callgrind, start-up
cancelled out by subtracting a short run from a long one. It still moves by
about ±0.5 % of a step from run to run (memory layout, and output that is
timed: under callgrind's ~50x slowdown the progress line and the stdout
flush, each at most once a second, run far more often per step than they do
at full speed, which counts against sailfin); compare several runs.

    python benchmarks/overhead.py [--rounds 9] [--steps 3000] [--threads 1]
    python benchmarks/overhead.py --instructions     # needs valgrind; about 10 minutes
    python benchmarks/overhead.py --watchdog 300     # also sailfin with the watchdog on
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import statistics
import sys
import tempfile
import time
from typing import Optional

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import add_load_options, interleave, spread, start, summary  # noqa: E402
from sailfin import Callback, DataInterface, ModuleInterface, Trainer, TrainerArguments  # noqa
from sailfin.config import CheckpointArguments, EmaArguments  # noqa: E402
from sailfin.config.distributed import DistArguments  # noqa: E402

BATCH = 32
LOG_EVERY = 10
HANG_SECONDS = None  # --watchdog: trainer.distributed.hang_seconds (null: off)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def make_data(steps: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = steps * BATCH
    return torch.utils.data.TensorDataset(torch.randn(n, 64, generator=g),
                                          torch.randint(0, 10, (n,), generator=g))


# -- A: the hand-written loop -------------------------------------------------------------
def run_raw(ds) -> tuple[float, float]:
    """Seconds per step: (steady, end to end)."""
    begin = time.perf_counter()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=True)
    start = time.perf_counter()
    for step, (x, y) in enumerate(loader, 1):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % LOG_EVERY == 0:
            print(f"step {step} loss {loss.item():.4f}")
    end = time.perf_counter()
    return (end - start) / len(loader), (end - begin) / len(loader)


# -- B: sailfin -------------------------------------------------------------------------
class Data(DataInterface):
    def __init__(self, ds):
        self.ds = ds

    def get_train_dataset(self):
        return self.ds


class Recipe(ModuleInterface):
    def __init__(self, data):
        super().__init__()
        self.data = data
        self.net = make_model()

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [torch.optim.SGD(self.parameters(), lr=0.01)], []

    def train_step(self, global_step, batch, device):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)


class LastStep(Callback):
    """When the last optimizer step ended (the steady clock's stop)."""

    at = 0.0

    def on_step_end(self, trainer):
        self.at = time.perf_counter()


def run_sailfin(ds, out_dir, ema: Optional[float] = None,
                hang_seconds: Optional[float] = None) -> tuple[float, float]:
    """Seconds per step: (steady, end to end)."""
    begin = time.perf_counter()
    module = Recipe(Data(ds))
    args = TrainerArguments(epochs=1, train_batch_size=BATCH, log_every_n_steps=LOG_EVERY,
                            output_dir=out_dir, val_every_n_epochs=0,
                            ema=EmaArguments(decay=ema),  # decay None: off
                            # no checkpoints, as Lightning's enable_checkpointing=False below
                            checkpoint=CheckpointArguments(at_epoch_end=False),
                            distributed=DistArguments(hang_seconds=hang_seconds))
    last = LastStep()
    trainer = Trainer(module, args, callbacks=[last])
    trainer.setup()
    start = time.perf_counter()
    steps = trainer.train()["global_step"]
    end = time.perf_counter()
    return (last.at - start) / steps, (end - begin) / steps


# -- optional: other trainers around the same model ------------------------------------
def run_lightning(ds, out_dir) -> float:
    import lightning as L

    class LitModel(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    begin = time.perf_counter()
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=True)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=LOG_EVERY,
                        default_root_dir=out_dir)
    trainer.fit(LitModel(), loader)
    per_step = (time.perf_counter() - begin) / len(loader)
    return per_step, per_step  # fit() does its own set-up: end to end only


def run_fabric(ds, out_dir) -> float:
    from lightning.fabric import Fabric

    begin = time.perf_counter()
    fabric = Fabric(accelerator="cpu", devices=1)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(
        torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=True))
    start = time.perf_counter()
    for step, (x, y) in enumerate(loader, 1):
        loss = nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % LOG_EVERY == 0:
            print(f"step {step} loss {loss.item():.4f}")
    end = time.perf_counter()
    return (end - start) / len(loader), (end - begin) / len(loader)


def run_accelerate(ds, out_dir) -> float:
    from accelerate import Accelerator

    begin = time.perf_counter()
    accelerator = Accelerator(cpu=True)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    start = time.perf_counter()
    steps = 0
    for step, (x, y) in enumerate(loader, 1):
        loss = nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps = step
        if step % LOG_EVERY == 0:
            print(f"step {step} loss {loss.item():.4f}")
    end = time.perf_counter()
    return (end - start) / steps, (end - begin) / steps


OTHERS = {"lightning": ("lightning", run_lightning), "fabric": ("lightning", run_fabric),
          "accelerate": ("accelerate", run_accelerate)}


# -- the load-independent figure: instructions per step under callgrind ----------------
def run_child(variant: str, steps: int) -> None:
    ds = make_data(steps)
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        run_raw(ds) if variant == "raw" else run_sailfin(ds, tmp, hang_seconds=HANG_SECONDS)


def count_instructions(short: int = 200, long: int = 600) -> None:
    """Instructions per step = (I(long) - I(short)) / (long - short): start-up, imports
    and set-up cancel out, and the count does not depend on what else the machine runs."""
    import re
    import shutil
    import subprocess

    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (apt-get install valgrind)")
    counts: dict[tuple[str, int], int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        jobs = {}
        for variant in ("raw", "sailfin"):
            for steps in (short, long):
                cmd = ["valgrind", "--tool=callgrind",
                       f"--callgrind-out-file={tmp}/{variant}-{steps}.out", sys.executable,
                       os.path.abspath(__file__), "--child", variant, str(steps)]
                if HANG_SECONDS is not None:
                    cmd += ["--watchdog", str(HANG_SECONDS)]
                jobs[(variant, steps)] = subprocess.Popen(
                    cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                    env={**os.environ, "PYTHONHASHSEED": "0"})  # the same dict layouts
        for key, proc in jobs.items():
            _, err = proc.communicate()
            found = re.search(r"Collected : (\d+)", err)
            if proc.returncode != 0 or found is None:
                raise SystemExit(f"callgrind run {key} failed:\n{err[-2000:]}")
            counts[key] = int(found.group(1))
    per_step = {v: (counts[(v, long)] - counts[(v, short)]) / (long - short)
                for v in ("raw", "sailfin")}
    print(f"instructions per step (callgrind, {long} - {short} steps of batch {BATCH}):")
    for variant, n in per_step.items():
        print(f"{variant:>10}: {n:,.0f}")
    extra = per_step["sailfin"] - per_step["raw"]
    print(f"sailfin's own work per step: {extra:+,.0f} instructions "
          f"({extra / per_step['raw']:+.3%} of the raw loop's step); "
          f"instruction ratio raw / sailfin = {per_step['raw'] / per_step['sailfin']:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", "--pairs", type=int, default=9)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1 keeps the timing steadier)")
    parser.add_argument("--no-others", action="store_true",
                        help="skip Lightning/Fabric/Accelerate even when installed")
    parser.add_argument("--instructions", action="store_true",
                        help="instead of timing, count instructions per step under "
                             "valgrind's callgrind (independent of the machine's load; "
                             "about 10 minutes)")
    parser.add_argument("--ema", type=float, default=None, metavar="DECAY",
                        help="also run sailfin with trainer.ema.decay DECAY and print "
                             "the cost of the average per step")
    parser.add_argument("--watchdog", type=float, default=None, metavar="SECONDS",
                        help="also run sailfin with the hang watchdog on (hang_seconds "
                             "SECONDS; on one process it is off unless asked) in the same "
                             "rounds; with --instructions, count that variant instead")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "STEPS"),
                        help=argparse.SUPPRESS)  # one run under callgrind
    add_load_options(parser)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    global HANG_SECONDS
    HANG_SECONDS = opts.watchdog
    if opts.child:
        return run_child(opts.child[0], int(opts.child[1]))
    if opts.instructions:
        return count_instructions()
    load = start(opts, "overhead.py")
    ds = make_data(opts.steps)
    others = {} if opts.no_others else {
        name: fn for name, (pkg, fn) in OTHERS.items() if importlib.util.find_spec(pkg)}
    if opts.ema is not None:
        others["sailfin+ema"] = lambda ds, out: run_sailfin(ds, out, ema=opts.ema)
    if opts.watchdog is not None:  # the same trainer with the watchdog's thread running
        others["sailfin+watchdog"] = lambda ds, out: run_sailfin(ds, out,
                                                                 hang_seconds=opts.watchdog)
    results: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        def variant(name, fn):
            def run(i):
                sink = io.StringIO()
                with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                    results[name] = (fn(ds) if name == "raw"
                                     else fn(ds, os.path.join(tmp, f"{name}{i}")))
                return results[name][0]  # steady seconds per step
            return run

        variants = {"raw": variant("raw", run_raw), "sailfin": variant("sailfin", run_sailfin)}
        variants.update({name: variant(name, fn) for name, fn in others.items()})
        ends: dict[str, list[float]] = {name: [] for name in variants}

        def on_round(i, steady):
            for name in variants:
                ends[name].append(results[name][1])
            print(f"round {i}: raw {1 / steady['raw']:8.1f} steps/s | " + " | ".join(
                f"{k} {steady['raw'] / v:.3f}" for k, v in steady.items() if k != "raw")
                + f" | load1 {os.getloadavg()[0]:.2f}", flush=True)

        rounds = interleave(opts.rounds, variants, on_round=on_round)
    raw_rates = [1 / r["raw"] for r in rounds]
    print(f"\nraw loop: median {statistics.median(raw_rates):.1f} steps/s "
          f"({opts.steps} steps of batch {BATCH}, {opts.threads} thread(s))")
    print("speed relative to the raw loop, per-round ratios (steady clock: after set-up, "
          "to the last step; end to end: all of it):")
    for name in variants:
        if name == "raw":
            continue
        steady = [r["raw"] / r[name] for r in rounds]
        whole = [a / b for a, b in zip(ends["raw"], ends[name])]
        print(f"{name:>10}: steady {spread(steady)}; end to end {spread(whole)}")
    if "sailfin+ema" in variants:  # seconds per step with the average minus without
        cost = [r["sailfin+ema"] - r["sailfin"] for r in rounds]
        params = sum(p.numel() for p in make_model().parameters())
        print(f"EMA (decay {opts.ema}, every step, {params:,} parameters): median "
              f"{statistics.median(cost) * 1e6:+.1f} us per step (min "
              f"{min(cost) * 1e6:+.1f}, max {max(cost) * 1e6:+.1f})")
    if "sailfin+watchdog" in variants:
        paired = [r["sailfin"] / r["sailfin+watchdog"] for r in rounds]
        print(f"watchdog on / off (same rounds): median {statistics.median(paired):.3f} "
              f"(min {min(paired):.3f}, max {max(paired):.3f})")
    if not others and not opts.no_others:
        print("(install the bench extra to compare Lightning, Fabric and Accelerate)")
    sailfin_whole = [a / b for a, b in zip(ends["raw"], ends["sailfin"])]
    summary("overhead.py", "sailfin / raw loop steps/s (steady, per-round)",
            [r["raw"] / r["sailfin"] for r in rounds], load, opts.threads,
            extra=f"end to end {statistics.median(sailfin_whole):.3f}")


if __name__ == "__main__":
    main()
