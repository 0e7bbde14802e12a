"""Elastic recovery under torchrun: how long a worker's death costs, per checkpoint interval.

A 2-worker job (gloo on loopback, ``--max-restarts 3``) trains the tests' small
recipe with a fixed step time; one worker is SIGKILLed at the same step for
each checkpoint interval. Two figures per run:

* recovery: from the kill to the first optimizer step finished after the
  restart (failure detection, rendezvous, process start, checkpoint load);
* steps lost: steps done after the checkpoint the run resumed from, which the
  restarted group trains again.

Runs alternate between the intervals; medians over rounds.

    python benchmarks/elastic_recovery.py [--rounds 3] [--intervals 4 16] [--kill-at 30]
"""

from __future__ import annotations

import argparse
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

from tests.distributed.elastic_helpers import (STEPS_PER_EPOCH, pid_of, reached,  # noqa: E402
                                               records, single_node, stop, tail, torchrun,
                                               wait, wait_until, write_config)


def one_run(tmp: Path, name: str, every: int, kill_at: int, step_seconds: float,
            epochs: int) -> dict:
    cfg = write_config(tmp, name, every=every, step_seconds=step_seconds, epochs=epochs)
    recs, log = tmp / name / "records", tmp / f"{name}.log"
    # Only the step interval saves: epoch-end saves would blur the comparison.
    proc = torchrun(single_node(2, cfg) + ["--trainer.checkpoint.at_epoch_end", "false"], log)
    try:
        wait_until(lambda: reached(recs, 1, "0-") >= kill_at, [proc], 300, [log],
                   f"step {kill_at}")
        os.kill(pid_of(recs, 1, "0-w2"), signal.SIGKILL)
        killed = time.time()
        if wait([proc], 600, [log]) != [0]:
            raise RuntimeError("the job failed:\n" + tail([log]))
    finally:
        stop(proc)
    before = [r for r in records(recs) if r["attempt"].startswith("0-")]
    after = sorted((r for r in records(recs) if r["attempt"].startswith("1-")),
                   key=lambda r: r["time"])
    last_before = max(r["step"] for r in before)
    resumed_from = min(r["step"] for r in after) - 1
    return {"recovery": after[0]["time"] - killed, "lost": last_before - resumed_from,
            "resumed_from": resumed_from}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--intervals", type=int, nargs="+", default=[4, 16],
                        help="trainer.checkpoint.every_n_steps values to compare")
    parser.add_argument("--kill-at", type=int, default=30,
                        help="kill a worker once it has finished this step")
    parser.add_argument("--step-seconds", type=float, default=0.1)
    add_load_options(parser)
    opts = parser.parse_args()
    load = start(opts, "elastic_recovery.py")
    epochs = opts.kill_at // STEPS_PER_EPOCH + 2
    results: dict[int, list[dict]] = {every: [] for every in opts.intervals}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(opts.rounds):
            order = opts.intervals if i % 2 == 0 else list(reversed(opts.intervals))
            for every in order:
                r = one_run(Path(tmp), f"r{i}-every{every}", every, opts.kill_at,
                            opts.step_seconds, epochs)
                results[every].append(r)
                print(f"round {i + 1}, every {every:3d} steps: recovery {r['recovery']:5.1f} s, "
                      f"{r['lost']} step(s) lost (resumed from step {r['resumed_from']})",
                      flush=True)
    print(f"\nkill at step {opts.kill_at}, 2 workers, steps of {opts.step_seconds} s; "
          f"medians over {opts.rounds} rounds")
    for every, runs in results.items():
        recovery = statistics.median(r["recovery"] for r in runs)
        lost = statistics.median(r["lost"] for r in runs)
        print(f"checkpoint every {every:3d} steps: death -> first step after restart "
              f"{recovery:5.1f} s; steps lost {lost:.0f} "
              f"(= {lost * opts.step_seconds:.1f} s of training to redo)")
    first = opts.intervals[0]
    summary("elastic_recovery.py", f"death -> first step after restart, seconds (every {first} "
            "steps, per round)", [r["recovery"] for r in results[first]], load, "1 per worker",
            extra=", ".join(f"every {e}: {statistics.median(r['lost'] for r in rs):.0f} steps "
                            "lost" for e, rs in results.items()))


if __name__ == "__main__":
    main()
