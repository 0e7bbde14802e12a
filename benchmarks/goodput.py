"""Goodput under failures: a 2-worker torchrun job with a worker killed every N seconds.

Each arm trains the same run (the elastic tests' recipe, a fixed step time, 2
workers over gloo, ``--max-restarts`` high) while this script SIGKILLs rank 1
every ``--kill-every`` seconds (never before the restarted job has finished a
step), until ``--minutes`` have passed; then the job trains to its end. Arms:

* ``disk every K``: checkpoints every K steps;
* ``memory every step``: memory snapshots every step (and disk every K);
* ``auto``: ``trainer.checkpoint.every_n_steps: auto`` (Young-Daly from the
  measured save and step times and the failures the run has seen, or
  ``--mtbf-hours``).

Two goodputs per arm, which should agree: sailfin's own time account
(``summary.json``: productive / wall), and an independent clock: steps kept x
the ideal step time (a run with no kill and no checkpoint, measured first) /
the wall time this script measured from launching torchrun to its exit (which
also holds torchrun's own start, so it reads a little lower).

    python benchmarks/goodput.py                         # about 4 minutes
    python benchmarks/goodput.py --minutes 5 --kill-every 30 --epochs 200
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import add_load_options, start, summary  # noqa: E402

from sailfin.checkpoint import snapshot_dirs  # noqa: E402
from tests.distributed.elastic_helpers import (STEPS_PER_EPOCH, records, single_node,  # noqa
                                               stop, tail, torchrun, wait, write_config)


def arm_flags(arm: str, every: int, mtbf_hours: float | None) -> list[str]:
    flags = ["--trainer.checkpoint.at_epoch_end", "false"]
    if arm == "ideal":
        return flags + ["--trainer.checkpoint.every_n_steps", "null"]
    if arm == "memory":
        flags += ["--trainer.checkpoint.memory.every_n_steps", "1"]
    if arm == "auto":
        flags += ["--trainer.checkpoint.every_n_steps", "auto"]
        if mtbf_hours is not None:
            flags += ["--trainer.checkpoint.mtbf_hours", str(mtbf_hours)]
    return flags


def started_steps(recs: Path, attempt: int) -> int:
    """Steps rank 1 has finished in torchrun round ``attempt``."""
    return sum(1 for r in records(recs) if r["rank"] == 1
               and r["attempt"].startswith(f"{attempt}-"))


def worker_pid(recs: Path, attempt: int) -> int | None:
    found = list(recs.glob(f"pid-rank1-{attempt}-w2-pid*"))
    return int(found[0].read_text()) if found else None


def run_arm(tmp: Path, name: str, arm: str, opts: argparse.Namespace) -> dict:
    cfg = write_config(tmp, name, every=opts.every, step_seconds=opts.step_seconds,
                       epochs=opts.epochs)
    recs, log, run = tmp / name / "records", tmp / f"{name}.log", tmp / name / "run"
    args = single_node(2, cfg, restarts=1000) + arm_flags(arm, opts.every, opts.mtbf_hours)
    began = time.time()
    proc = torchrun(args, log)
    kills, attempt = 0, 0
    try:
        last_kill = began
        while arm != "ideal" and proc.poll() is None and time.time() - began < 60 * opts.minutes:
            # Every N seconds, but only once the restarted job has trained a step.
            if time.time() - last_kill >= opts.kill_every and started_steps(recs, attempt):
                pid = worker_pid(recs, attempt)
                if pid is not None:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass  # it was ending anyway
                    kills, attempt, last_kill = kills + 1, attempt + 1, time.time()
            time.sleep(0.05)
        if wait([proc], 1800, [log]) != [0]:
            raise RuntimeError("the job failed:\n" + tail([log]))
    finally:
        stop(proc)
        snapshot_dirs.clean(str(run))
    wall = time.time() - began
    account = json.loads((run / "summary.json").read_text())["time_account"]
    steps = json.loads((run / "summary.json").read_text())["global_step"]
    return {"wall": wall, "kills": kills, "steps": steps, "account": account,
            "records": records(recs)}


def ideal_step_seconds(recs: list[dict]) -> float:
    """The median time between rank 0's consecutive steps in the run without failures."""
    times = sorted(r["time"] for r in recs if r["rank"] == 0)
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=0.75,
                        help="how long workers are killed for (then the job finishes)")
    parser.add_argument("--kill-every", type=float, default=12.0, help="seconds")
    parser.add_argument("--every", type=int, default=8, help="disk checkpoints every K steps")
    parser.add_argument("--epochs", type=int, default=8,
                        help=f"{STEPS_PER_EPOCH} steps each")
    parser.add_argument("--step-seconds", type=float, default=0.1)
    parser.add_argument("--mtbf-hours", type=float, default=None,
                        help="for the auto arm (default: the failures it has seen)")
    add_load_options(parser)
    opts = parser.parse_args()
    load = start(opts, "goodput.py")
    arms = [("ideal", "no kills, no checkpoints"), ("disk", f"disk every {opts.every}"),
            ("memory", "memory every step"), ("auto", "auto")]
    results = {}
    with tempfile.TemporaryDirectory(prefix="sailfin-goodput-") as tmp_name:
        for arm, label in arms:
            results[arm] = r = run_arm(Path(tmp_name), arm, arm, opts)
            print(f"{label:>24}: {r['kills']} kill(s), {r['steps']} steps in {r['wall']:.1f} s; "
                  f"sailfin's account: goodput {100 * r['account']['goodput']:.1f}% of "
                  f"{r['account']['wall_seconds']:.1f} s", flush=True)
    ideal = ideal_step_seconds(results["ideal"]["records"])
    print(f"\n2 workers, steps of {opts.step_seconds} s (ideal step measured {ideal:.3f} s), "
          f"a worker killed every {opts.kill_every:.0f} s for {opts.minutes:g} min")
    print(f"{'arm':>24} | kills | goodput (account) | goodput (outside clock) | "
          "replayed s | restart gap s | start-up s | checkpoint+snapshot s")
    # The outside clock: steps kept x the ideal step time / the wall this script measured.
    outside = {a: results[a]["steps"] * ideal / results[a]["wall"] for a, _ in arms}
    for arm, label in arms:
        r, acc = results[arm], results[arm]["account"]
        sec = acc["seconds"]
        print(f"{label:>24} | {r['kills']:5d} | {100 * acc['goodput']:16.1f}% | "
              f"{100 * outside[arm]:22.1f}% | {sec['replayed']:10.2f} | "
              f"{sec['restart_gap']:13.2f} | {sec['startup']:10.2f} | "
              f"{sec['checkpoint'] + sec['snapshot']:8.2f}")
    summary("goodput.py", "goodput of the auto arm, sailfin's account",
            [results["auto"]["account"]["goodput"]], load, "1 per worker",
            extra=", ".join(f"{label}: account {100 * results[a]['account']['goodput']:.1f}% "
                            f"outside clock {100 * outside[a]:.1f}% ({results[a]['kills']} kills)"
                            for a, label in arms))

if __name__ == "__main__":
    main()
