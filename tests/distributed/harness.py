"""Run a function on W local processes (spawned, gloo on 127.0.0.1) with a deadline.

Each rank gets a manual ``trainer.distributed`` config, so no environment
variable of the test process changes. A rank that raises writes its error to
``error-<rank>.txt``; a run that outlives its deadline is killed and fails the
test instead of hanging it.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
from collections import defaultdict
import socket
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from sailfin.config.distributed import DistArguments


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def manual(rank: int, world: int, port: int) -> DistArguments:
    return DistArguments(launcher="manual", rank=rank, world_size=world,
                         master_addr="127.0.0.1", master_port=port, timeout_seconds=60,
                         threads_per_process=1)


def _entry(fn: Callable, rank: int, world: int, port: int, out: str, kwargs: dict) -> None:
    try:
        fn(rank=rank, world=world, dist_args=manual(rank, world, port), out=Path(out),
           **kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent through a file
        Path(out, f"error-{rank}.txt").write_text(
            f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        raise


def run_ranks(fn: Callable, world: int, out: Path, timeout: float = 120,
              **kwargs: Any) -> list[int]:
    """Run ``fn(rank=, world=, dist_args=, out=, **kwargs)`` on ``world`` processes.

    Returns the exit codes. ``fn`` must be importable (module level).
    """
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, str(out), kwargs))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        if hung:
            raise AssertionError(f"ranks {hung} still running after {timeout} s: a hang")
        return [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def errors(out: Path) -> dict[int, str]:
    return {int(f.stem.split("-")[1]): f.read_text() for f in out.glob("error-*.txt")}


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own,
    so killing the agent's process group would leave them running)."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[ppid].append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and everything below it, then reap it."""
    if proc.poll() is None:
        for pid in [proc.pid, *descendants(proc.pid)]:  # listed before the parent dies
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()


def reset_peak_rss() -> bool:
    """Start VmHWM afresh from the current RSS (Linux 4.0+); False where that is refused:
    the peak then still holds older highs, so a measure against it is an upper bound."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False
