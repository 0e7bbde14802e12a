"""The hang watchdog under ``sailfin launch``: a rank stopped with SIGSTOP, rank 0 or rank 1.

Each run: two CPU workers, ``hang_seconds: 5``; once both train, one worker is
stopped. The other names it within hang_seconds plus a few seconds, ends the stopped
process (a stopped process takes only SIGKILL; torchrun would wait 30 s for it),
and the launcher exits 75 with a closing line that says the watchdog ended the job,
not that checkpoints were saved. The stopped worker is always continued and killed
in teardown.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.distributed.elastic_helpers import ROOT, reached, stop, tail, wait, wait_until, \
    write_config

HANG = 5


def _launch(cfg, log, *extra):
    args = ["--nnodes=1", "--nproc-per-node=2", "--max-restarts=0", "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:0", "--monitor-interval=0.1", "-m", "sailfin", "train",
            str(cfg), "--trainer.backend", "ddp", "--trainer.distributed.hang_seconds",
            str(HANG), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with open(log, "ab") as fh:
        return subprocess.Popen([sys.executable, "-m", "sailfin", "launch", *args], env=env,
                                stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)


def _release(pid: int) -> None:
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_a_stopped_rank_is_named_and_the_job_ends_with_75(tmp_path, rank):
    cfg = write_config(tmp_path, "job", every=3, step_seconds=0.1)
    records, log = tmp_path / "job" / "records", tmp_path / "job.log"
    proc = _launch(cfg, log)
    pid = None
    try:
        wait_until(lambda: reached(records, 0, "0-") >= 2, [proc], 180, [log], "step 2")
        [pid_file] = records.glob(f"pid-rank{rank}-*")
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        [code] = wait([proc], 90, [log])
        took = time.monotonic() - stopped
    finally:
        if pid is not None:
            _release(pid)
        stop(proc)
    text = log.read_text(errors="replace")
    assert code == 75, tail([log])
    assert took < HANG + 12, (took, tail([log]))  # not torchrun's 30 s wait, nor gloo's
    header = next(line for line in text.splitlines() if "hang watchdog: no progress" in line)
    assert f"waiting for rank {rank}" in header, header
    [frozen] = [line for line in text.splitlines() if f"rank {rank}: its records stopped" in line]
    assert "phase starting" not in frozen, frozen  # training's first record is written at once
    assert f"ended the frozen process(es) of rank {rank}" in text
    assert "sailfin launch: the hang watchdog ended the job" in text
    assert "saved a checkpoint" not in text.split("sailfin launch:")[-1]
    assert "Traceback" not in text, tail([log])


@pytest.mark.slow
def test_a_rank_stuck_in_the_check_batch_is_named(tmp_path):
    """The sanity validation batch runs before the first step: it is watched too."""
    cfg = write_config(tmp_path, "job", every=3, step_seconds=0.0)
    cfg.write_text(cfg.read_text().replace("elastic_recipe.ElasticRecipe",
                                           "hang_recipe.StuckInCheckRecipe"))
    log = tmp_path / "job.log"
    proc = _launch(cfg, log)
    try:
        [code] = wait([proc], 120, [log])
    finally:
        stop(proc)
    text = log.read_text(errors="replace")
    began = float((tmp_path / "job" / "records" / "check-began").read_text())
    assert code == 75, tail([log])
    header = next(line for line in text.splitlines() if "hang watchdog: no progress" in line)
    assert "waiting for rank 1 (in start-up checks (sanity validation batches))" in header
    assert "in val_step" in (tmp_path / "job" / "run" / "hang" / "stack-rank1.txt").read_text()
    assert "sailfin launch: the hang watchdog ended the job" in text
    assert time.time() - began < HANG + 20


@pytest.mark.slow
def test_a_rank_slow_alone_in_validation_is_named_alone(tmp_path):
    """(#34) Rank 0 done with its validation batches waits for rank 1's outputs: the report
    used to say 'all ranks in validation'."""
    cfg = write_config(tmp_path, "job", every=100, step_seconds=0.0, epochs=2)
    cfg.write_text(cfg.read_text().replace("elastic_recipe.ElasticRecipe",
                                           "hang_recipe.SlowValidationOnRank1"))
    log = tmp_path / "job.log"
    proc = _launch(cfg, log, "--trainer.distributed.hang_seconds_slow_phases", str(HANG))
    try:
        [code] = wait([proc], 120, [log])
    finally:
        stop(proc)
    text = log.read_text(errors="replace")
    assert code == 75, tail([log])
    header = next(line for line in text.splitlines() if "hang watchdog: no progress" in line)
    assert "waiting for rank 1 (in validation)" in header, header
    assert "all ranks" not in header
    assert "rank 0: global_step 12, phase validation (gathering every rank's outputs)" in text
