"""kill -9 a single-process run with memory snapshots every step: it resumes from the
last or the last-but-one step and ends bit-identical to an uninterrupted run."""

import json
import os
import random
import re
import time

import pytest

from tests.checkpoint.test_kill import assert_same_run, kill, start, wait_for, write_config
from sailfin.cli import main


def memory_config(tmp_path, name, step_seconds=0.08):
    shm = tmp_path / f"{name}-shm"
    return write_config(tmp_path, name, step_seconds, checkpoint=(
        f"keep_last: 2, memory: {{every_n_steps: 1, dir: '{shm}'}}")), shm


def logged_step(out) -> int:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [json.loads(line)["step"] for line in lines if line.endswith("}")]
    return max(steps, default=0)


@pytest.mark.slow
def test_kill_9_with_memory_snapshots_loses_at_most_one_step(tmp_path):
    ref_config, ref_shm = memory_config(tmp_path, "ref", step_seconds=0)
    assert main(["train", str(ref_config)]) == 0
    assert not ref_shm.exists()  # removed at the normal end
    config, shm = memory_config(tmp_path, "run")
    out, log = tmp_path / "run", tmp_path / "run.log"
    seed = int(os.environ.get("SAILFIN_TEST_SEED") or time.time())  # a failure's seed reruns it
    rng = random.Random(seed)
    kills, proc, at_kill = 0, None, []
    try:
        while True:
            proc = start(config, log)
            if kills == 3:
                assert proc.wait(timeout=300) == 0, log.read_text()
                break
            target = logged_step(out) + rng.randint(2, 6)
            if wait_for(lambda: logged_step(out) >= target, proc):
                time.sleep(rng.uniform(0.0, 0.05))  # mid-step or mid-snapshot
            if proc.poll() is not None:
                break
            kill(proc)
            at_kill.append(logged_step(out))
            kills += 1
    finally:
        if proc is not None:
            kill(proc)
    text = log.read_text()
    assert kills == 3, f"the run ended after {kills} kills (random seed {seed}):\n{text}"
    # Each restart resumes from the newest state: a memory snapshot, or a disk checkpoint
    # written after the newest complete snapshot. A step waits for the previous snapshot's
    # write before it is logged, so the snapshot of the step before the last one logged is
    # complete however loaded the machine is.
    resumed = [int(s) for s in re.findall(r"sailfin: resuming from \S+: step (\d+)", text)]
    assert len(resumed) == 3, (seed, text)
    # Each from memory, or from a disk checkpoint newer than every complete snapshot: a
    # kill just after a disk checkpoint's step, before its snapshot is written, finds that
    # checkpoint newer (the run says so).
    from_memory = text.count("resuming from memory")
    from_newer_disk = (text.count("is older than the disk checkpoint of step")
                       + text.count("memory snapshots: none is held"))
    assert from_memory + from_newer_disk == 3, (seed, text)
    for step, logged in zip(resumed, at_kill):
        assert logged - 1 <= step <= logged, (resumed, at_kill, seed)  # last or last-but-one
    assert_same_run(out, tmp_path / "ref")
    assert not shm.exists()
