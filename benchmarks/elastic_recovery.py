"""Elastic recovery under torchrun: how long a worker's death costs, per checkpoint interval.

A 2-worker job (gloo on loopback, ``--max-restarts 3``) trains the tests' small
recipe with a fixed step time; one worker is SIGKILLed at the same step for
each checkpoint interval. Two figures per run:

* recovery: from the kill to the first optimizer step finished after the
  restart (failure detection, rendezvous, process start, checkpoint load);
* steps lost: steps done after the checkpoint the run resumed from, which the
  restarted group trains again.

Runs alternate between the intervals; medians over rounds. ``--memory`` adds
an arm with memory snapshots every step (disk checkpoints every 16), and two
arms of a simulated node loss: two torchrun agents of one worker each
(``--nnodes 2`` on loopback); the killed worker's snapshot directory is removed
with it, and it comes back from the replica on the other node (``replicas: 1``)
or, without one, from disk.

    python benchmarks/elastic_recovery.py [--rounds 3] [--intervals 4 16] [--kill-at 30]
                                          [--memory]
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import add_load_options, start, summary  # noqa: E402

import torch.distributed as dist  # noqa: E402

from sailfin.checkpoint import snapshot_dirs  # noqa: E402
from tests.distributed.elastic_helpers import (STEPS_PER_EPOCH, pid_of, reached,  # noqa: E402
                                               records, single_node, stop, tail, torchrun,
                                               wait, wait_until, write_config)
from tests.distributed.harness import free_port  # noqa: E402

MEMORY = "--trainer.checkpoint.memory.every_n_steps"


def one_run(tmp: Path, name: str, every: int, kill_at: int, step_seconds: float,
            epochs: int, arm: str = "disk") -> dict:
    """arm: "disk" (checkpoints every ``every``), "memory" (and snapshots every step),
    "node-replica" / "node-disk" (two nodes, the killed one's memory lost with it)."""
    cfg = write_config(tmp, name, every=every, step_seconds=step_seconds, epochs=epochs)
    recs, logs = tmp / name / "records", [tmp / f"{name}.log"]
    run = str(tmp / name / "run")
    # Only the step interval saves: epoch-end saves would blur the comparison.
    extra = ["--trainer.checkpoint.at_epoch_end", "false"]
    if arm != "disk":
        extra += [MEMORY, "1"]
    store = None
    if arm.startswith("node"):
        extra += ["--trainer.checkpoint.memory.replicas", "1" if arm == "node-replica" else "0"]
        port = free_port()
        store = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True,
                              wait_for_workers=False, timeout=datetime.timedelta(seconds=120))
        args = ["--nnodes=2", "--nproc-per-node=1", "--max-restarts=3", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={name}",
                "--monitor-interval=0.1", "--rdzv-conf=is_host=false", "-m", "sailfin",
                "train", str(cfg), "--trainer.backend", "ddp"] + extra
        logs.append(tmp / f"{name}-b.log")
        env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        procs = [torchrun(args, logs[0], env), torchrun(args, logs[1], env)]
    else:
        procs = [torchrun(single_node(2, cfg) + extra, logs[0])]
    try:
        wait_until(lambda: reached(recs, 1, "0-") >= kill_at, procs, 300, logs,
                   f"step {kill_at}")
        os.kill(pid_of(recs, 1, "0-w2"), signal.SIGKILL)
        killed = time.time()
        if arm.startswith("node"):  # the node's memory goes with it
            shutil.rmtree(snapshot_dirs.snapshot_root(None, run, 1), ignore_errors=True)
        if wait(procs, 600, logs) != [0] * len(procs):
            raise RuntimeError("the job failed:\n" + tail(logs))
    finally:
        stop(*procs)
        snapshot_dirs.clean(run)
        del store
    # The killed worker (rank 1): its records before and after its restart.
    before = [r for r in records(recs) if r["attempt"].startswith("0-") and r["rank"] == 1]
    after = sorted((r for r in records(recs) if r["attempt"].startswith("1-")
                    and r["rank"] == 1), key=lambda r: r["time"])
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
    parser.add_argument("--memory", action="store_true",
                        help="also: memory snapshots every step, and a node lost with and "
                             "without a replica")
    add_load_options(parser)
    opts = parser.parse_args()
    load = start(opts, "elastic_recovery.py")
    epochs = opts.kill_at // STEPS_PER_EPOCH + 2
    arms: list[tuple[str, int, str]] = [(f"disk every {e:3d}", e, "disk")
                                        for e in opts.intervals]
    if opts.memory:
        arms += [("memory every 1 (disk 16)", 16, "memory"),
                 ("node lost, replica", 16, "node-replica"),
                 ("node lost, no replica (disk 16)", 16, "node-disk")]
    results: dict[str, list[dict]] = {label: [] for label, _, _ in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(opts.rounds):
            for j, (label, every, arm) in enumerate(arms if i % 2 == 0 else arms[::-1]):
                r = one_run(Path(tmp), f"r{i}-{j}-{arm}-{every}", every, opts.kill_at,
                            opts.step_seconds, epochs, arm)
                results[label].append(r)
                print(f"round {i + 1}, {label}: recovery {r['recovery']:5.1f} s, "
                      f"{r['lost']} step(s) lost (resumed from step {r['resumed_from']})",
                      flush=True)
    print(f"\nkill at step {opts.kill_at}, 2 workers, steps of {opts.step_seconds} s; "
          f"medians over {opts.rounds} rounds")
    for label, runs in results.items():
        recovery = statistics.median(r["recovery"] for r in runs)
        lost = statistics.median(r["lost"] for r in runs)
        print(f"{label:>32}: death -> first step after restart "
              f"{recovery:5.1f} s; steps lost {lost:.0f} "
              f"(= {lost * opts.step_seconds:.1f} s of training to redo)")
    first = arms[0][0]
    summary("elastic_recovery.py", f"death -> first step after restart, seconds ({first.strip()}"
            ", per round)", [r["recovery"] for r in results[first]], load, "1 per worker",
            extra=", ".join(f"{label.strip()}: {statistics.median(r['lost'] for r in rs):.0f} "
                            "steps lost" for label, rs in results.items()))


if __name__ == "__main__":
    main()
