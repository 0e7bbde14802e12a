"""sailfin's Trainer against the loop a user would write by hand, the trainer's own
overhead, what batched fetching gains, and (``--against REV``) an earlier sailfin.

The same tiny MLP (64 -> 256 -> 256 -> 10, batch 32, SGD), the same data in the
same order (sailfin's permutation for seed 42), trained by (``_overhead_arms.py``):

- ``hand-per-sample``, **the reference**: a hand-written loop over the standard
  ``DataLoader`` (``dataset[i]`` per sample, then ``default_collate``);
- ``sailfin``: the Trainer as a user runs it, default writers and progress, no
  checkpoints (over a ``TensorDataset`` it gathers each batch in one call);
- ``hand``: the hand loop fetching whole batches by index exactly as sailfin's
  loader does (``_hand.batched_loader``; sailfin/data/batched.py);
- ``sailfin-per-sample``: the Trainer over a dataset it does not gather, so its
  loader is the reference's standard ``DataLoader``;
- ``hand-direct``: the hand loop indexing the tensors itself, no ``DataLoader``;
- Lightning's Trainer, Lightning Fabric and Accelerate when installed, on the
  same batched loader as ``hand``;
- with ``--against REV``: ``sailfin@REV``, the sailfin of that git rev (checked out
  to a temporary worktree, imported in a child process through ``PYTHONPATH``;
  ``_against.py``), and ``sailfin@here``, this tree's the same way.

Every loop does the same work per step and ends with the same weights (checked
and printed). The figures, steps/s over steps/s, per round:

(0) sailfin / hand-per-sample: the Trainer against the hand loop over the standard
    DataLoader (the summary line);
(1) trainer overhead = sailfin / hand (the same batched fetch; 1.00 = none), and
(1b) the same on the standard DataLoader = sailfin-per-sample / hand-per-sample;
(2) batched fetch gain = hand / hand-per-sample;
(3) with --against: sailfin@here / sailfin@REV, both in fresh processes (below 1:
    this tree is slower per step).

Clocks, the same for every variant: steady (after set-up, to the end of the
last optimizer step) and end to end (from before anything is built to the
return). Rounds interleave, each figure is the median of per-round ratios
(``_measure.py``), printed with the load before and after. Two counts the
machine's load does not move: ``--bytecodes`` counts Python bytecodes and C calls
per step, by function (``_bytecodes.py``; runs anywhere, a minute; with
``--against REV`` REV's too, and which functions moved), ``--instructions`` machine
instructions per step under callgrind (``_callgrind.py``; needs valgrind, and
an idle machine: torch's import under callgrind alone takes minutes);
``--profile`` prints which functions sailfin's step spends more in than the hand
loop's (cProfile: times inflated by the profiler, call counts exact).

    python benchmarks/overhead.py [--rounds 9] [--steps 3000] [--threads 1]
    python benchmarks/overhead.py --against 8132136   # + the earlier release, same rounds
    python benchmarks/overhead.py --bytecodes [--against 8132136]  # load-independent
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
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _against import FROM_PYTHONPATH, checkout, run_child as against_child, say_result  # noqa
if not os.environ.get(FROM_PYTHONPATH):  # --against's children import an earlier sailfin
    sys.path.insert(1, os.path.dirname(HERE))

from _bytecodes import Counts, per_step  # noqa: E402
from _callgrind import instructions_per_step  # noqa: E402
from _hand import BATCH, make_data  # noqa: E402
from _measure import add_load_options, interleave, machine, spread, start, summary  # noqa
from _overhead_arms import LOADERS, PEERS, REFERENCE, run_child, run_variant  # noqa: E402

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


def count_one(name: str, opts: argparse.Namespace) -> dict[str, Any]:
    """Per-step counts of one variant (``_bytecodes.per_step``), its functions named by
    their path inside the tree (``sailfin/...``), so that two trees' counts compare."""
    import sailfin

    roots = [os.path.dirname(os.path.dirname(os.path.abspath(sailfin.__file__))) + os.sep,
             os.path.dirname(HERE) + os.sep]  # sailfin's tree, and this one's benchmarks/
    run_child(name, 20, opts)  # warm: lazy imports happen before the count
    runs = []
    for steps in (opts.short, opts.long):
        ds = make_data(steps)
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
            runs.append(Counts.measure(lambda: run_variant(name, ds, tmp, opts)))
    counted = per_step(runs[0], runs[1], opts.long - opts.short)
    counted["by_function"] = {f"{tree_path(path, roots)} {fn}": n
                              for (path, fn), n in counted["by_function"].items()}
    return counted


def tree_path(path: str, roots: list[str]) -> str:
    """``path`` inside the first of ``roots`` that holds it (as it is elsewhere)."""
    return next((path[len(root):] for root in roots if path.startswith(root)), path)


def count_bytecodes(opts: argparse.Namespace) -> None:
    """Python bytecodes and C calls per step (``_bytecodes.py``), and where sailfin's extra
    bytecodes are, per function; with ``--against REV`` that sailfin's counts too."""
    names = ["hand", "sailfin", "hand-per-sample"]
    counted = {name: count_one(name, opts) for name in names}
    earlier = f"sailfin@{opts.against}" if opts.against else None
    if earlier:
        with checkout(opts.against) as tree:
            counted[earlier] = against_child(
                [sys.executable, os.path.abspath(__file__), "--child-count", "sailfin",
                 "--short", str(opts.short), "--long", str(opts.long)], tree)["counts"]
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
    if earlier:
        old = counted[earlier]
        print(f"(3) this tree against {opts.against}: {sail['opcodes'] / old['opcodes']:.4f}x "
              f"the bytecodes ({sail['opcodes'] - old['opcodes']:+,.1f}) and "
              f"{sail['c_calls'] / old['c_calls']:.4f}x the C calls per step; by function:")
        moved = collections.Counter(sail["by_function"])
        moved.subtract(old["by_function"])
        for where, n in sorted(moved.items(), key=lambda kv: -abs(kv[1]))[:opts.top // 2]:
            if abs(n) >= 0.05:
                print(f"{n:+9.1f}  {where[-100:]}")
    diff = collections.Counter(sail["by_function"])
    diff.subtract(hand["by_function"])
    print(f"bytecodes per step, sailfin minus hand, by function (share of sailfin's "
          f"{sail['opcodes']:,.0f}):")
    for where, n in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:opts.top]:
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
    parser.add_argument("--against", metavar="REV",
                        help="also run the sailfin of git rev REV (checked out to a temporary "
                             "worktree) in the same rounds, and this tree's beside it, each in "
                             "a fresh process: the per-step ratio of the two (with "
                             "--bytecodes: REV's counts)")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "STEPS"),
                        help=argparse.SUPPRESS)  # one run under callgrind
    parser.add_argument("--child-time", nargs=2, metavar=("VARIANT", "STEPS"),
                        help=argparse.SUPPRESS)  # one timed run for --against
    parser.add_argument("--child-count", metavar="VARIANT",
                        help=argparse.SUPPRESS)  # one variant's counts for --against
    add_load_options(parser)
    opts = parser.parse_args()
    opts.trees = {}  # variant name -> the tree its sailfin is imported from (--against)
    torch.set_num_threads(opts.threads)
    if opts.child:
        return run_child(opts.child[0], int(opts.child[1]), opts)
    if opts.child_time:
        steady, whole, weights = run_child(opts.child_time[0], int(opts.child_time[1]), opts)
        return say_result({"steady": steady, "whole": whole, "weights": weights})
    if opts.child_count:
        return say_result({"counts": count_one(opts.child_count, opts)})
    if opts.instructions:
        return count_instructions(opts)
    if opts.bytecodes:
        return count_bytecodes(opts)
    if opts.profile:
        return profile(opts)
    load = start(opts, "overhead.py")
    names = ["hand-per-sample", "sailfin", "hand", "sailfin-per-sample", "hand-direct"]
    if not opts.no_others:
        names += [name for name, (pkg, _) in PEERS.items() if importlib.util.find_spec(pkg)]
    if opts.ema is not None:
        names.append("sailfin+ema")
    if opts.watchdog is not None:
        names.append("sailfin+watchdog")
    if opts.against:
        with checkout(opts.against) as tree:
            opts.trees = {"sailfin@here": os.path.dirname(HERE),
                          f"sailfin@{opts.against}": tree}
            rounds, ends, weights = timed_rounds(names + list(opts.trees), opts)
    else:
        rounds, ends, weights = timed_rounds(names, opts)
    report(rounds, ends, weights, load, opts)


def timed_rounds(names: list[str], opts: argparse.Namespace) -> tuple[list, dict, dict]:
    """Interleaved rounds of ``names``: each round's steady seconds per step by name, and
    by name every round's end-to-end seconds per step and final weights' fingerprint."""
    ds = make_data(opts.steps)
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
            ref = steady[REFERENCE]
            print(f"round {i}: {REFERENCE} {1 / ref:8.1f} steps/s | " + " | ".join(
                f"{k} {ref / v:.3f}" for k, v in steady.items() if k != REFERENCE)
                + f" | load1 {os.getloadavg()[0]:.2f}", flush=True)

        rounds = interleave(opts.rounds, {name: variant(name) for name in names},
                            on_round=on_round)
    return rounds, ends, weights


def report(rounds: list, ends: dict, weights: dict, load: Any, opts: argparse.Namespace
           ) -> None:
    names = list(ends)
    rates = [1 / r[REFERENCE] for r in rounds]
    print(f"\nhand loop over the standard DataLoader (the reference): median "
          f"{statistics.median(rates):.1f} steps/s ({opts.steps} steps of batch {BATCH}, "
          f"{opts.threads} thread(s), on {opts.device})")
    same = {name: weights[name] == weights["hand"] for name in names
            if name in LOADERS or name.startswith("sailfin") and "+" not in name}
    print("same final weights as the hand loop (same work per step): " +
          ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in same.items()))
    print("steps/s relative to the hand loop over the standard DataLoader, per-round ratios "
          "(steady: after set-up, to the last step; end to end: all of it):")
    for name in names:
        if name != REFERENCE:
            steady = [r[REFERENCE] / r[name] for r in rounds]
            whole = [a / b for a, b in zip(ends[REFERENCE], ends[name])]
            print(f"{name:>18}: steady {spread(steady)}; end to end {spread(whole)}")

    def ratio(over: str, under: str) -> list[float]:  # steps/s of `over` / of `under`
        return [r[under] / r[over] for r in rounds]

    figures = {"(1) trainer overhead on the same batched fetch, sailfin / hand":
               ratio("sailfin", "hand"),
               "(1b) trainer overhead on the standard DataLoader, sailfin-per-sample / "
               "hand-per-sample": ratio("sailfin-per-sample", REFERENCE),
               "(2) batched fetch gain, hand / hand-per-sample": ratio("hand", REFERENCE)}
    if "sailfin+ema" in names:  # seconds per step with the average minus without
        cost = [r["sailfin+ema"] - r["sailfin"] for r in rounds]
        print(f"EMA (decay {opts.ema}, every step): median "
              f"{statistics.median(cost) * 1e6:+.1f} us per step (min "
              f"{min(cost) * 1e6:+.1f}, max {max(cost) * 1e6:+.1f})")
    if "sailfin+watchdog" in names:
        figures["watchdog on / off"] = ratio("sailfin+watchdog", "sailfin")
    if opts.against:
        figures[f"(3) this tree / {opts.against}, sailfin@here / sailfin@{opts.against} "
                "(each run in a fresh process)"] = ratio("sailfin@here",
                                                         f"sailfin@{opts.against}")
    for what, values in figures.items():
        print(f"{what}: {spread(values)}")
    summary("overhead.py", "(0) sailfin / hand loop over the standard DataLoader, steps/s "
            "(steady, per-round)", ratio("sailfin", REFERENCE), load, opts.threads,
            extra="; ".join(f"{what.split(',')[0]} {statistics.median(v):.3f}"
                            for what, v in figures.items()))


if __name__ == "__main__":
    main()
