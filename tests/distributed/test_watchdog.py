"""The hang watchdog's judgement, on threads in one process sharing a store."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from sailfin.config import ConfigError
from sailfin.config.distributed import DistArguments
from sailfin.distributed.watchdog import (BACKWARD, END_OF_STEP, FORWARD, HANG_EXIT_CODE,
                                          VALIDATION, Heartbeat, RankRecord, Watchdog,
                                          culprits, hang_report, resolve_hang_seconds)


def test_the_rank_furthest_behind_is_named():
    records = [RankRecord(0, 4, BACKWARD, 12.0), RankRecord(1, 4, FORWARD, 12.5),
               RankRecord(2, 4, BACKWARD, 12.1)]
    assert culprits(records) == [1]
    lines = hang_report(records, 10)
    assert "waiting for rank 1" in lines[0]
    assert lines[2] == ("  rank 1: global_step 4, phase forward/train_step, 12.5 s since its "
                        "last progress   <- stuck")
    # A rank a step behind is behind whatever its phase.
    assert culprits([RankRecord(0, 5, FORWARD, 1), RankRecord(1, 4, END_OF_STEP, 1)]) == [1]
    same = hang_report([RankRecord(0, 4, BACKWARD, 11), RankRecord(1, 4, BACKWARD, 11)], 10)
    assert "every rank is at the same place" in same[0]
    from sailfin.distributed.watchdog import FAILED, FINISHED
    failed = hang_report([RankRecord(0, 4, BACKWARD, 11), RankRecord(1, 4, FAILED, 0),
                          RankRecord(2, 4, FINISHED, 0)], 10)
    assert "waiting for rank 1" in failed[0] and "phase stopped by an error" in failed[2]
    frozen = hang_report([RankRecord(0, 4, BACKWARD, 11), RankRecord(1, 4, BACKWARD, 0)], 10,
                         stale={1: 11.0})
    assert "waiting for rank 1" in frozen[0] and "records stopped 11 s ago" in frozen[2]
    late = hang_report([RankRecord(0, 0, FORWARD, 11), RankRecord(1, 0, "starting", 11, -1)],
                       10, stale={1: 11.0})
    assert "waiting for rank 1" in late[0] and "still in set-up or resume" in late[2]


def test_hang_seconds_setting():
    assert resolve_hang_seconds("auto", 2) == 300 and resolve_hang_seconds("auto", 1) is None
    assert resolve_hang_seconds(None, 8) is None and resolve_hang_seconds(5, 1) == 5.0
    assert DistArguments(hang_seconds=None).hang_seconds is None
    with pytest.raises(ConfigError, match="trainer.distributed.hang_seconds must be > 0"):
        DistArguments(hang_seconds=0)
    with pytest.raises(ConfigError, match="hang_seconds"):
        DistArguments(hang_seconds="soon")


def _pair(tmp_path, hang=0.6):
    store = dist.HashStore()
    exits: dict[int, int] = {}
    done = threading.Event()

    def on_hang(rank):
        def record(code):
            exits[rank] = code
            if len(exits) == 2:
                done.set()
        return record

    beats = [Heartbeat(), Heartbeat()]
    dogs = [Watchdog(beats[r], store, r, 2, hang, interval=0.05, report_dir=str(tmp_path),
                     on_hang=on_hang(r)) for r in range(2)]
    return beats, dogs, exits, done


def test_a_stuck_rank_ends_every_rank_with_its_stack(tmp_path, capfd):
    beats, dogs, exits, done = _pair(tmp_path)
    beats[0].step, beats[0].phase = 4, BACKWARD   # waits in the gradient all-reduce
    beats[1].step, beats[1].phase = 4, FORWARD    # stuck in train_step of step 5
    started = time.monotonic()
    for d in dogs:
        d.start()
    try:
        assert done.wait(10), "the watchdog did not fire"
    finally:
        for d in dogs:
            d.stop()
    assert time.monotonic() - started < 0.6 + 3
    assert exits == {0: HANG_EXIT_CODE, 1: HANG_EXIT_CODE}
    [report] = [d.report for d in dogs if d.report]  # ranks 0 and 1 judge: one reports
    assert "waiting for rank 1" in report[0]
    assert any("rank 1: global_step 4, phase forward/train_step" in line for line in report)
    err = capfd.readouterr().err
    assert "stack of rank 1 (global_step 4, phase forward/train_step" in err
    assert "Thread" in (tmp_path / "stack-rank1.txt").read_text()  # faulthandler's dump
    assert (tmp_path / "stack-rank0.txt").exists()


def test_progress_and_a_finished_rank_are_no_hang(tmp_path):
    beats, dogs, exits, done = _pair(tmp_path, hang=0.5)
    for d in dogs:
        d.start()
    try:
        for step in range(30):  # both ranks move on every 0.05 s for 1.5 s
            for b in beats:
                b.step, b.phase = step, FORWARD if step % 2 else BACKWARD
            time.sleep(0.05)
        dogs[1].stop()  # rank 1 is done; rank 0 still works a while (a final save)
        for i in range(20):
            beats[0].beats += 1
            time.sleep(0.05)
    finally:
        for d in dogs:
            d.stop()
    assert exits == {} and not done.is_set()


def test_a_frozen_rank_is_named_when_its_records_stop(tmp_path):
    beats, dogs, exits, done = _pair(tmp_path, hang=0.5)
    dogs[1]._publish(0.0, 0)  # one record, then nothing: its thread never runs
    dogs[0].start()
    stop = threading.Event()

    def work():  # rank 0 itself keeps moving
        while not stop.is_set():
            beats[0].beats += 1
            time.sleep(0.02)

    mover = threading.Thread(target=work)
    mover.start()
    try:
        deadline = time.monotonic() + 10
        while 0 not in exits and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        mover.join()
        dogs[0].stop()
    assert exits == {0: HANG_EXIT_CODE}
    assert "waiting for rank 1" in dogs[0].report[0]
    assert "records stopped" in dogs[0].report[2]


def test_a_frozen_rank_0_is_named_by_rank_1(tmp_path):
    """Rank 0 judges every rank, and rank 1 judges rank 0: a frozen rank 0 is caught."""
    beats, dogs, exits, done = _pair(tmp_path, hang=0.5)
    dogs[0]._publish(0.0, 0)  # rank 0's one record, then nothing: it is frozen
    dogs[1].start()
    try:
        deadline = time.monotonic() + 10
        while 1 not in exits and time.monotonic() < deadline:
            beats[1].beats += 1  # rank 1 itself keeps moving
            time.sleep(0.02)
    finally:
        dogs[1].stop()
    assert exits == {1: HANG_EXIT_CODE}
    assert "waiting for rank 0" in dogs[1].report[0]
    assert "rank 0: its records stopped" in dogs[1].report[1]


def test_a_rank_slow_alone_is_named_alone():
    """Both ranks in validation: rank 0 finished its batches and waits (idle past the
    limit), rank 1 still works through its own: rank 1 is named, not 'all ranks'."""
    lines = hang_report([RankRecord(0, 4, VALIDATION, 41), RankRecord(1, 4, VALIDATION, 0.8)],
                        10, slow_seconds=40)
    assert "waiting for rank 1 (in validation)" in lines[0], lines
    assert lines[2].endswith("<- stuck") and not lines[1].endswith("<- stuck")
    one_batch = hang_report([RankRecord(0, 4, VALIDATION, 41),  # on one long batch
                             RankRecord(1, 4, VALIDATION, 30)], 10, slow_seconds=40)
    assert "waiting for rank 1 (in validation)" in one_batch[0], one_batch
    together = hang_report([RankRecord(0, 4, VALIDATION, 41), RankRecord(1, 4, VALIDATION, 40.2)],
                           10, slow_seconds=40)
    assert "all ranks in validation" in together[0]


def test_a_frozen_process_on_this_host_is_ended(tmp_path):
    """A stopped process takes no signal but SIGKILL: the live rank on its host ends it,
    so that torchrun does not wait 30 s before killing it itself."""
    import signal
    import subprocess
    import sys

    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        frozen.send_signal(signal.SIGSTOP)
        beats, dogs, exits, done = _pair(tmp_path, hang=0.5)
        dogs[1]._process = (frozen.pid, dogs[0]._process[1])  # rank 1 is that process
        dogs[1]._publish(0.0, 0)
        dogs[0].start()
        deadline = time.monotonic() + 10
        while 0 not in exits and time.monotonic() < deadline:
            beats[0].beats += 1
            time.sleep(0.02)
        dogs[0].stop()
        assert exits == {0: HANG_EXIT_CODE}
        assert frozen.wait(5) == -signal.SIGKILL
    finally:
        if frozen.poll() is None:
            frozen.send_signal(signal.SIGCONT)
            frozen.kill()
            frozen.wait()


@pytest.mark.slow
def test_a_rank_stuck_in_train_step_ends_the_ddp_job_naming_it(tmp_path, capfd):
    """Rank 1 sleeps forever in train_step of step 5: within hang_seconds plus a few
    seconds both processes exit with 75, and rank 0's report names rank 1 and step 5."""
    from tests.distributed.harness import errors, run_ranks
    from tests.distributed.workers import train

    out = tmp_path / "hang"
    out.mkdir()
    marker = tmp_path / "hang-began"
    hang = 3.0
    codes = run_ranks(train, 2, out, timeout=120, data={"n_train": 200, "n_val": 0},
                      trainer={"epochs": 1, "train_batch_size": 10, "micro_batch_size": 5,
                               "distributed_hang_seconds": hang},
                      recipe={"hang_rank": 1, "hang_step": 5, "marker": str(marker)},
                      kind="hang")
    ended = time.time()
    assert codes == [HANG_EXIT_CODE, HANG_EXIT_CODE], errors(out)
    took = ended - float(marker.read_text())
    err = capfd.readouterr().err
    with capfd.disabled():
        print(f"\nhang to exit: {took:.1f} s with hang_seconds {hang}\n{err}")
    assert took < hang + 10
    assert "waiting for rank 1" in err
    assert "rank 1: global_step 4, phase forward/train_step" in err
    assert "rank 0: global_step 4, phase backward" in err
    assert "stack of rank 1 (global_step 4, phase forward/train_step" in err
    assert "in train_step" in (out / "run" / "hang" / "stack-rank1.txt").read_text()


@pytest.mark.slow
def test_torchrun_restarts_a_hung_job_which_then_finishes_exactly(tmp_path):
    """The same hang under torchrun --max-restarts 2: the watchdog ends the first attempt,
    torchrun restarts it, the run resumes from its last checkpoint (step 3) and ends where
    an uninterrupted run ends, every sample once per epoch."""
    from safetensors.torch import load_file

    from sailfin.cli import main
    from tests.distributed.elastic_helpers import (final_steps, single_node, stop, tail,
                                                   torchrun, wait, write_config)
    from tests.distributed.test_elastic import check

    assert main(["train", str(write_config(tmp_path, "ref", step_seconds=0))]) == 0
    reference = (load_file(str(tmp_path / "ref" / "run" / "final" / "model.safetensors")),
                 final_steps(tmp_path / "ref" / "records"))
    cfg = write_config(tmp_path, "hang", every=3, step_seconds=0.02)
    text = cfg.read_text()
    cfg.write_text(text.replace("elastic_recipe.ElasticRecipe", "hang_recipe.HangOnceRecipe")
                   .replace("momentum: 0.9}", "momentum: 0.9, hang_step: 5}"))
    log = tmp_path / "hang.log"
    proc = torchrun(single_node(2, cfg, restarts=2)
                    + ["--trainer.distributed.hang_seconds", "3"], log)
    try:
        assert wait([proc], 240, [log]) == [0], tail([log])
    finally:
        stop(proc)
    check(tmp_path, "hang", reference)
    text = log.read_text()
    assert "waiting for rank 1" in text
    assert "rank 1: global_step 4, phase forward/train_step" in text
    assert "restart 1 (torchrun): resuming from" in text
    assert (tmp_path / "hang" / "records" / "hang-began").exists()


@pytest.mark.slow
def test_log_lines_name_the_slowest_rank(tmp_path):
    """Rank 1 spends 50 ms more per forward: each log line's step_time_slowest is rank 1's,
    although both ranks' wall-clock steps are equally long (they wait for each other)."""
    import json

    from tests.distributed.test_ddp import ddp

    ddp(tmp_path, {"n_train": 80, "n_val": 0},
        {"epochs": 1, "train_batch_size": 8, "micro_batch_size": 2, "log_every_n_steps": 2},
        {"slow_rank": 1, "seconds": 0.05}, kind="slow")
    lines = [json.loads(x) for x in
             (tmp_path / "ddp" / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [e for e in lines if e["split"] == "train"]
    assert len(train) == 5
    for e in train:
        assert e["slowest_rank"] == 1
        assert e["step_time_slowest"] >= 2 * 0.05  # two forwards a step on each rank
        assert e["step_time_slowest"] > e["step_time_median"]
