"""Two figures, named for what they are: the trainer's own overhead, and what batched
fetching gains over the standard ``DataLoader``.

The same tiny MLP (64 -> 256 -> 256 -> 10, batch 32, SGD), the same data in the
same order (sailfin's permutation for seed 42), trained by:

- ``hand``: a hand-written loop that fetches whole batches by index exactly as
  sailfin's loader does (``_hand.batched_loader``: a ``DataLoader`` whose dataset
  gathers each batch with one ``index_select`` per tensor; sailfin/data/batched.py);
- ``sailfin``: the Trainer, default writers and progress, no checkpoints;
- ``hand-per-sample``: the hand loop with the standard ``DataLoader``
  (``dataset[i]`` per sample, then ``default_collate``);
- ``hand-direct``: the hand loop indexing the tensors itself, no ``DataLoader``
  (what the ``DataLoader`` machinery costs);
- Lightning's Trainer, Lightning Fabric and Accelerate when installed, on the
  same batched loader as ``hand``.

Every loop does the same work per step and ends with the same weights (checked
and printed). The figures:

(1) trainer overhead = sailfin steps/s / hand steps/s (same fetch; 1.00 = none);
(2) batched fetch gain = hand steps/s / hand-per-sample steps/s.

Clocks, the same for every variant: steady (after set-up, to the end of the
last optimizer step) and end to end (from before anything is built to the
return). Rounds interleave, each figure is the median of per-round ratios
(``_measure.py``). Two counts the machine's load does not move:
``--bytecodes`` counts Python bytecodes and C calls per step, by function
(``_bytecodes.py``; runs anywhere, a minute), ``--instructions`` machine
instructions per step under callgrind (``_callgrind.py``; needs valgrind, and
an idle machine: torch's import under callgrind alone takes minutes);
``--profile`` prints which functions sailfin's step spends more in than the hand
loop's (cProfile: times inflated by the profiler, call counts exact).

    python benchmarks/overhead.py [--rounds 9] [--steps 3000] [--threads 1]
    python benchmarks/overhead.py --bytecodes         # load-independent, by function
    python benchmarks/overhead.py --instructions      # needs valgrind; minutes
    python benchmarks/overhead.py --profile
    python benchmarks/overhead.py --watchdog 300 --ema 0.999   # extra sailfin variants
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import io
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from _bytecodes import Counts, per_step  # noqa: E402
from _callgrind import instructions_per_step  # noqa: E402
from _hand import (BATCH, batched_loader, direct_batches, fingerprint, make_data,  # noqa: E402
                   make_model, per_sample_loader, synchronize)
from _measure import add_load_options, interleave, machine, spread, start, summary  # noqa
from _peers import PEERS  # noqa: E402
from sailfin import Callback, DataInterface, ModuleInterface, Trainer, TrainerArguments  # noqa
from sailfin.config import CheckpointArguments, EmaArguments  # noqa: E402
from sailfin.config.distributed import DistArguments  # noqa: E402

LOG_EVERY = 10
LOADERS: dict[str, Callable[[Any], Any]] = {
    "hand": batched_loader, "hand-per-sample": per_sample_loader, "hand-direct": direct_batches}


# -- the hand-written loop -----------------------------------------------------------------
def run_hand(ds, fetch: str = "hand", device: str = "cpu") -> tuple[float, float, float]:
    """Seconds per step (steady, end to end) and the final weights' fingerprint."""
    begin = time.perf_counter()
    model = make_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = LOADERS[fetch](ds)
    start = time.perf_counter()
    step = 0
    for step, (x, y) in enumerate(batches, 1):
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % LOG_EVERY == 0:
            print(f"step {step} loss {loss.item():.4f}")
    synchronize(device)
    end = time.perf_counter()
    return (end - start) / step, (end - begin) / step, fingerprint(model)


# -- sailfin -------------------------------------------------------------------------------
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
        return nn.functional.cross_entropy(self.net(x.to(device)), y.to(device))


class LastStep(Callback):
    """When the last optimizer step ended (the steady clock's stop)."""

    at = 0.0

    def __init__(self, last_step: int, device: str = "cpu") -> None:
        self.last_step, self.device = last_step, device

    def on_step_end(self, trainer):
        if trainer.global_step == self.last_step:  # as the hand loop: wait for the device once
            synchronize(self.device)
        self.at = time.perf_counter()


def run_sailfin(ds, out_dir, ema: Optional[float] = None, hang_seconds: Optional[float] = None,
                device: str = "cpu") -> tuple[float, float, float]:
    """Seconds per step (steady, end to end) and the final weights' fingerprint."""
    begin = time.perf_counter()
    module = Recipe(Data(ds))
    args = TrainerArguments(epochs=1, train_batch_size=BATCH, log_every_n_steps=LOG_EVERY,
                            output_dir=out_dir, val_every_n_epochs=0,
                            ema=EmaArguments(decay=ema),  # decay None: off
                            # no checkpoints, as Lightning's enable_checkpointing=False
                            checkpoint=CheckpointArguments(at_epoch_end=False),
                            distributed=DistArguments(hang_seconds=hang_seconds), device=device)
    last = LastStep(len(ds) // BATCH, device)
    trainer = Trainer(module, args, callbacks=[last])
    trainer.setup()
    start = time.perf_counter()
    steps = trainer.train()["global_step"]
    end = time.perf_counter()
    return (last.at - start) / steps, (end - begin) / steps, fingerprint(module.net)


def run_variant(name: str, ds, out_dir: str, opts: argparse.Namespace) -> tuple[float, ...]:
    device = opts.device
    if name in LOADERS:
        return run_hand(ds, name, device)
    if name == "sailfin":
        return run_sailfin(ds, out_dir, device=device)
    if name == "sailfin+ema":
        return run_sailfin(ds, out_dir, ema=opts.ema, device=device)
    if name == "sailfin+watchdog":  # the same trainer with the watchdog's thread running
        return run_sailfin(ds, out_dir, hang_seconds=opts.watchdog, device=device)
    steady, whole = PEERS[name][1](make_model, batched_loader(ds), out_dir, LOG_EVERY, device)
    return steady, whole, float("nan")


# -- the load-independent figure and the profile ----------------------------------------------
def run_child(variant: str, steps: int, opts: argparse.Namespace) -> None:
    ds = make_data(steps)
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        run_variant(variant, ds, tmp, opts)


def count_instructions(opts: argparse.Namespace) -> None:
    names = ["hand", "sailfin", "hand-per-sample"]
    if opts.watchdog is not None:
        names.append("sailfin+watchdog")
    extra = ["--watchdog", str(opts.watchdog)] if opts.watchdog is not None else []
    counts = instructions_per_step(
        {n: (lambda steps, n=n: [sys.executable, os.path.abspath(__file__), "--child", n,
                                 str(steps), *extra]) for n in names},
        short=opts.short, long=opts.long)
    print(f"instructions per step (callgrind, {opts.long} - {opts.short} steps of batch "
          f"{BATCH}; {machine()}):")
    for name, n in counts.items():
        print(f"{name:>18}: {n:,.0f}")
    own = counts["sailfin"] - counts["hand"]
    print(f"(1) trainer overhead: sailfin's own work {own:+,.0f} instructions per step "
          f"({own / counts['hand']:+.2%} of the hand loop's step); "
          f"instruction ratio hand / sailfin = {counts['hand'] / counts['sailfin']:.4f}")
    print(f"(2) batched fetch: instruction ratio hand-per-sample / hand = "
          f"{counts['hand-per-sample'] / counts['hand']:.3f}")


def count_bytecodes(opts: argparse.Namespace) -> None:
    """Python bytecodes and C calls per step (``_bytecodes.py``), and where sailfin's extra
    bytecodes are, per function."""
    names = ["hand", "sailfin", "hand-per-sample"]
    counted = {}
    for name in names:
        run_child(name, 20, opts)  # warm: lazy imports happen before the count
        runs = []
        for steps in (opts.short, opts.long):
            ds = make_data(steps)
            with tempfile.TemporaryDirectory() as tmp, \
                    contextlib.redirect_stdout(io.StringIO()):
                runs.append(Counts.measure(lambda: run_variant(name, ds, tmp, opts)))
        counted[name] = per_step(runs[0], runs[1], opts.long - opts.short)
    print(f"Python work per step (sys.settrace opcodes + sys.setprofile C calls, main thread, "
          f"{opts.long} - {opts.short} steps of batch {BATCH}; {machine()}):")
    for name, c in counted.items():
        print(f"{name:>18}: {c['opcodes']:9,.1f} bytecodes, {c['c_calls']:7,.1f} C calls")
    hand, sail = counted["hand"], counted["sailfin"]
    print(f"(1) trainer overhead: sailfin {sail['opcodes'] - hand['opcodes']:+,.1f} bytecodes "
          f"({sail['opcodes'] / hand['opcodes']:.3f}x the hand loop's), "
          f"{sail['c_calls'] - hand['c_calls']:+,.1f} C calls "
          f"({sail['c_calls'] / hand['c_calls']:.3f}x) per step")
    per = counted["hand-per-sample"]
    print(f"(2) batched fetch: the standard DataLoader runs {per['opcodes'] / hand['opcodes']:.2f}x "
          f"the bytecodes and {per['c_calls'] / hand['c_calls']:.2f}x the C calls per step")
    diff = collections.Counter(sail["by_function"])
    diff.subtract(hand["by_function"])
    print(f"bytecodes per step, sailfin minus hand, by function (share of sailfin's "
          f"{sail['opcodes']:,.0f}):")
    for (path, fn), n in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:opts.top]:
        where = f"{os.path.relpath(path) if path.startswith('/') else path} {fn}"
        print(f"{n:+9.1f} {n / sail['opcodes']:+7.2%}  {where[-100:]}")
    calls = collections.Counter(sail["c_by_name"])
    calls.subtract(hand["c_by_name"])
    print("C calls per step, sailfin minus hand, by callee:")
    for name, n in sorted(calls.items(), key=lambda kv: -abs(kv[1]))[:opts.top // 2]:
        if n:
            print(f"{n:+9.2f}  {name}")


def profile(opts: argparse.Namespace) -> None:
    """Per-step cProfile time by function, sailfin minus the hand loop (same batches)."""
    import cProfile
    import pstats

    ds = make_data(opts.steps)
    stats = {}
    for name in ("hand", "sailfin"):
        run_child(name, 20, opts)  # warm: lazy imports, allocator
        prof = cProfile.Profile()
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
            prof.runcall(run_variant, name, ds, tmp, opts)
        stats[name] = pstats.Stats(prof).stats  # (file, line, fn) -> (cc, nc, tt, ct, callers)
    steps = opts.steps
    hand_total = sum(v[2] for v in stats["hand"].values()) / steps
    sail_total = sum(v[2] for v in stats["sailfin"].values()) / steps
    print(f"cProfile, {steps} steps ({machine()}): hand {hand_total * 1e6:.0f} us/step, "
          f"sailfin {sail_total * 1e6:.0f} us/step (profiled; set-up and final files included, "
          f"{steps} steps)")
    rows = []
    for key in set(stats["hand"]) | set(stats["sailfin"]):
        s = stats["sailfin"].get(key, (0, 0, 0.0, 0.0))
        h = stats["hand"].get(key, (0, 0, 0.0, 0.0))
        rows.append(((s[2] - h[2]) / steps, (s[1] - h[1]) / steps, s[3] / steps, key))
    rows.sort(key=lambda r: -r[0])
    print("own time per step, sailfin minus hand (share of the hand loop's profiled step), "
          "calls per step more, sailfin's cumulative per step:")
    for extra, calls, cum, (path, line, fn) in rows[:opts.top]:
        where = f"{os.path.relpath(path) if path.startswith('/') else path}:{line} {fn}"
        print(f"{extra * 1e6:+8.2f} us {extra / hand_total:+7.2%} {calls:+8.2f} calls "
              f"{cum * 1e6:9.2f} us  {where[-90:]}")


# -- the timed rounds ----------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", "--pairs", type=int, default=9)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1 keeps the timing steadier)")
    parser.add_argument("--device", default="cpu",
                        help="where every variant trains: cpu, or cuda (each moves its batches "
                             "there and waits for the device before its clock stops)")
    parser.add_argument("--no-others", action="store_true",
                        help="skip Lightning/Fabric/Accelerate even when installed")
    parser.add_argument("--instructions", action="store_true",
                        help="instead of timing, count instructions per step under "
                             "valgrind's callgrind (independent of the machine's load)")
    parser.add_argument("--bytecodes", action="store_true",
                        help="instead of timing, count Python bytecodes and C calls per "
                             "step (independent of the load; no valgrind needed; a minute)")
    parser.add_argument("--short", type=int, default=100,
                        help="--instructions/--bytecodes: steps of the short run")
    parser.add_argument("--long", type=int, default=300,
                        help="--instructions/--bytecodes: steps of the long run")
    parser.add_argument("--profile", action="store_true",
                        help="instead of timing, print where sailfin's step spends more "
                             "than the hand loop's (cProfile, --steps steps)")
    parser.add_argument("--top", type=int, default=25, help="--profile: rows to print")
    parser.add_argument("--ema", type=float, default=None, metavar="DECAY",
                        help="also run sailfin with trainer.ema.decay DECAY and print "
                             "the cost of the average per step")
    parser.add_argument("--watchdog", type=float, default=None, metavar="SECONDS",
                        help="also run sailfin with the hang watchdog on (hang_seconds "
                             "SECONDS) in the same rounds (and under --instructions)")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "STEPS"),
                        help=argparse.SUPPRESS)  # one run under callgrind
    add_load_options(parser)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    if opts.child:
        return run_child(opts.child[0], int(opts.child[1]), opts)
    if opts.instructions:
        return count_instructions(opts)
    if opts.bytecodes:
        return count_bytecodes(opts)
    if opts.profile:
        return profile(opts)
    load = start(opts, "overhead.py")
    ds = make_data(opts.steps)
    names = ["hand", "sailfin", "hand-per-sample", "hand-direct"]
    if not opts.no_others:
        names += [name for name, (pkg, _) in PEERS.items() if importlib.util.find_spec(pkg)]
    if opts.ema is not None:
        names.append("sailfin+ema")
    if opts.watchdog is not None:
        names.append("sailfin+watchdog")
    results: dict[str, tuple[float, ...]] = {}
    ends: dict[str, list[float]] = {name: [] for name in names}
    weights: dict[str, set[float]] = {name: set() for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        def variant(name):
            def run(i):
                sink = io.StringIO()
                with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                    results[name] = run_variant(name, ds, os.path.join(tmp, f"{name}{i}"), opts)
                return results[name][0]  # steady seconds per step
            return run

        def on_round(i, steady):
            for name in names:
                ends[name].append(results[name][1])
                weights[name].add(results[name][2])
            print(f"round {i}: hand {1 / steady['hand']:8.1f} steps/s | " + " | ".join(
                f"{k} {steady['hand'] / v:.3f}" for k, v in steady.items() if k != "hand")
                + f" | load1 {os.getloadavg()[0]:.2f}", flush=True)

        rounds = interleave(opts.rounds, {name: variant(name) for name in names},
                            on_round=on_round)
    hand_rates = [1 / r["hand"] for r in rounds]
    print(f"\nhand loop (batched fetch): median {statistics.median(hand_rates):.1f} steps/s "
          f"({opts.steps} steps of batch {BATCH}, {opts.threads} thread(s), on {opts.device})")
    same = {name: weights[name] == weights["hand"] for name in names
            if name in LOADERS or name == "sailfin"}
    print("same final weights as the hand loop (same work per step): " +
          ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in same.items()))
    print("steps/s relative to the hand loop with the same batched fetch, per-round ratios "
          "(steady: after set-up, to the last step; end to end: all of it):")
    for name in names[1:]:
        steady = [r["hand"] / r[name] for r in rounds]
        whole = [a / b for a, b in zip(ends["hand"], ends[name])]
        print(f"{name:>18}: steady {spread(steady)}; end to end {spread(whole)}")
    if "sailfin+ema" in names:  # seconds per step with the average minus without
        cost = [r["sailfin+ema"] - r["sailfin"] for r in rounds]
        print(f"EMA (decay {opts.ema}, every step): median "
              f"{statistics.median(cost) * 1e6:+.1f} us per step (min "
              f"{min(cost) * 1e6:+.1f}, max {max(cost) * 1e6:+.1f})")
    if "sailfin+watchdog" in names:
        paired = [r["sailfin"] / r["sailfin+watchdog"] for r in rounds]
        print(f"watchdog on / off (same rounds): {spread(paired)}")
    gain = [r["hand-per-sample"] / r["hand"] for r in rounds]
    whole = [a / b for a, b in zip(ends["hand"], ends["sailfin"])]
    print(f"(2) batched fetch gain: hand loop batched / standard DataLoader {spread(gain)}")
    summary("overhead.py", "(1) trainer overhead: sailfin / hand loop on the same batched "
            "fetch, steps/s (steady, per-round)",
            [r["hand"] / r["sailfin"] for r in rounds], load, opts.threads,
            extra=f"end to end {statistics.median(whole):.3f}; (2) batched fetch gain {statistics.median(gain):.3f}")


if __name__ == "__main__":
    main()
