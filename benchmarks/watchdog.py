"""What the hang watchdog and the straggler figures cost.

1. The loop's share, per optimizer step: the attribute writes that publish the
   phase (data loading, forward, backward, optimizer, end of step) and the
   clock reads behind the straggler figures, timed against the same loop
   without them (``timeit``, best of several repeats: the figure is the cost
   of the added bytecode, not of a loaded machine).
2. The watchdog thread's work per wake-up (once a second): publishing this
   rank's record and, on rank 0, reading every rank's record, over a real
   ``TCPStore`` on loopback with ``--world`` records.

The time from a hang to the exit is measured by the slow test
``tests/distributed/test_watchdog.py::test_a_rank_stuck_in_train_step_ends_the_ddp_job_naming_it``
(it prints it), and the trainer against a raw loop with the watchdog on by
``benchmarks/overhead.py --watchdog 300``.

    python benchmarks/watchdog.py [--micro-batches 1] [--world 8]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import timeit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sailfin.distributed.watchdog import (BACKWARD, DATA, END_OF_STEP, FORWARD,  # noqa: E402
                                          OPTIMIZER, Heartbeat, Watchdog)


class _Trainer:
    _ready_seconds = 0.0


def loop_plain(steps: int, micros: int) -> None:
    for _ in range(steps):
        for _ in range(micros):
            pass


def loop_watched(steps: int, micros: int) -> None:
    """Exactly what Trainer._train_epoch adds per step and per micro-batch."""
    beat, clock, self = Heartbeat(), time.perf_counter, _Trainer()
    for step in range(steps):
        beat.step = step
        started = ready = clock()
        for _ in range(micros):
            beat.phase = DATA
            beat.phase = FORWARD
            beat.phase, ready = BACKWARD, clock()
        self._ready_seconds += ready - started
        beat.phase = OPTIMIZER
        beat.phase = END_OF_STEP


def per_step_ns(fn, steps: int, micros: int, repeat: int = 7) -> float:
    best = min(timeit.repeat(lambda: fn(steps, micros), number=1, repeat=repeat))
    return best / steps * 1e9


def thread_wakeup_us(world: int, rounds: int = 200) -> float:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    dogs = [Watchdog(Heartbeat(), store, r, world, hang_seconds=300) for r in range(world)]
    for d in dogs:
        d._publish(0.0, 0)
    rank0 = dogs[0]
    rank0._judge(time.monotonic())  # finds the keys once
    start = time.perf_counter()
    for i in range(rounds):  # what rank 0's thread does each second
        rank0._publish(0.5, i + 1)
        rank0._judge(time.monotonic())
        store.check(["sailfin/watchdog/hang"])
    return (time.perf_counter() - start) / rounds * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--world", type=int, default=8)
    opts = parser.parse_args()
    plain = per_step_ns(loop_plain, opts.steps, opts.micro_batches)
    watched = per_step_ns(loop_watched, opts.steps, opts.micro_batches)
    print(f"loop additions: {watched - plain:.0f} ns per optimizer step "
          f"({opts.micro_batches} micro-batch(es) a step; best of 7 x {opts.steps} steps)")
    wake = thread_wakeup_us(opts.world)
    print(f"watchdog thread, rank 0 with {opts.world} ranks' records on a loopback TCPStore: "
          f"{wake:.0f} us per wake-up, once a second = {wake / 1e4:.3f} % of one core")
    with open("/proc/loadavg") as fh:
        print(f"load average while measuring: {fh.read().split()[0]}")


if __name__ == "__main__":
    main()
