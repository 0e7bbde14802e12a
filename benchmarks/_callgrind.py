"""Instructions per step under valgrind's callgrind: a figure the machine's load cannot move.

Each variant runs twice in a fresh process, for a short and a long number of
steps; instructions per step = (I(long) - I(short)) / (long - short), so the
imports, set-up and final files cancel out. ``PYTHONHASHSEED`` is fixed (the
same dict layouts in every run). What is left moves by a few tenths of a
percent from run to run (memory layout, and anything timed: under callgrind's
~50x slowdown a once-a-second progress line runs ~50x more often per step);
compare several runs before reading a difference under 1 %.

    from _callgrind import instructions_per_step
    per_step = instructions_per_step({"hand": lambda n: [python, "x.py", "hand", str(n)]})
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from typing import Callable, Mapping, Sequence

_COLLECTED = re.compile(r"Collected : (\d+)")


def collected(stderr: str) -> int:
    """The instruction count callgrind prints at exit (``==123== Collected : 456``)."""
    found = _COLLECTED.findall(stderr)
    if not found:
        raise ValueError("callgrind printed no 'Collected :' line")
    return int(found[-1])


def per_step(short: tuple[int, int], long: tuple[int, int]) -> float:
    """Instructions per step from two (steps, instructions) runs: fixed costs cancel."""
    (s_steps, s_count), (l_steps, l_count) = short, long
    if l_steps <= s_steps:
        raise ValueError(f"the long run ({l_steps} steps) must be longer than the short "
                         f"({s_steps})")
    return (l_count - s_count) / (l_steps - s_steps)


def instructions_per_step(commands: Mapping[str, Callable[[int], Sequence[str]]],
                          short: int = 100, long: int = 300, parallel: int = 2
                          ) -> dict[str, float]:
    """Name -> instructions per step; ``commands[name](steps)`` is the command line of one
    run of ``steps`` steps. ``parallel`` runs at a time (callgrind is single-threaded)."""
    if shutil.which("valgrind") is None:
        raise SystemExit("instruction counts need valgrind (apt-get install valgrind)")
    jobs = [(name, steps) for name in commands for steps in (short, long)]
    counts: dict[tuple[str, int], int] = {}
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        running: list[tuple[tuple[str, int], subprocess.Popen]] = []

        def reap(proc_entry: tuple[tuple[str, int], subprocess.Popen]) -> None:
            key, proc = proc_entry
            _, err = proc.communicate()
            if proc.returncode != 0:
                raise SystemExit(f"callgrind run {key} failed:\n{err[-2000:]}")
            counts[key] = collected(err)

        for name, steps in jobs:
            if len(running) >= parallel:
                reap(running.pop(0))
            cmd = ["valgrind", "--tool=callgrind",
                   f"--callgrind-out-file={tmp}/{name}-{steps}.out", *commands[name](steps)]
            running.append(((name, steps), subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)))
        for entry in running:
            reap(entry)
    return {name: per_step((short, counts[(name, short)]), (long, counts[(name, long)]))
            for name in commands}
