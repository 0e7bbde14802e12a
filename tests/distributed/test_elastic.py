"""Elastic training under torchrun on loopback: workers killed by pid, the group resized
or joined by a second agent, a save interrupted; every run must end where an
uninterrupted run ends, with each sample trained on exactly once per epoch."""

from __future__ import annotations

import datetime
import json
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from sailfin.cli import main
from tests.distributed.elastic_helpers import (EPOCHS, STEPS_PER_EPOCH, all_executions,
                                               final_steps, pid_of, reached, single_node, stop,
                                               tail, torchrun, wait, wait_until, write_config)
from tests.distributed.harness import free_port

TOTAL = STEPS_PER_EPOCH * EPOCHS


DATA = ["map", "shards"]  # a map-style dataset, and the same samples streamed from shards


@pytest.fixture(scope="module", params=DATA)
def data(request):
    return request.param


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    """The uninterrupted run, in one process: its weights and the ids of every step."""
    tmp = tmp_path_factory.mktemp(f"reference-{data}")
    assert main(["train", str(write_config(tmp, "ref", step_seconds=0, data=data))]) == 0
    weights = load_file(str(tmp / "ref" / "run" / "final" / "model.safetensors"))
    return weights, final_steps(tmp / "ref" / "records")


def check(tmp: Path, name: str, reference) -> str:
    """Same model as the uninterrupted run; each epoch's samples exactly once; returns the log."""
    weights, ref_steps = reference
    got = load_file(str(tmp / name / "run" / "final" / "model.safetensors"))
    for key, value in weights.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6)
    summary = json.loads((tmp / name / "run" / "summary.json").read_text())
    assert summary["global_step"] == TOTAL
    steps = final_steps(tmp / name / "records")
    assert sorted(steps) == list(range(1, TOTAL + 1))
    assert steps == ref_steps  # step k trained on the same samples as without failures
    for epoch in range(EPOCHS):
        ids = [i for k in range(epoch * STEPS_PER_EPOCH + 1, (epoch + 1) * STEPS_PER_EPOCH + 1)
               for i in steps[k]]
        assert sorted(ids) == list(range(96))  # exactly once per epoch
    for step, runs in all_executions(tmp / name / "records").items():
        for ids in runs:  # a step re-run after a failure had the same samples
            assert set(ids) <= set(steps[step])
    events = [json.loads(line) for line in
              (tmp / name / "run" / "metrics.jsonl").read_text().splitlines()]
    train_steps = [e["step"] for e in events if e["split"] == "train"]
    assert train_steps == list(range(1, TOTAL + 1))  # metrics.jsonl reads as one run
    return ""


@pytest.mark.slow
def test_killed_workers_rejoin_and_finish_exactly(tmp_path, reference, data):
    """SIGKILL one of 2 workers mid-epoch, then the other one in the restarted group."""
    cfg = write_config(tmp_path, "kill", data=data)
    records, log = tmp_path / "kill" / "records", tmp_path / "kill.log"
    proc = torchrun(single_node(2, cfg), log)
    try:
        wait_until(lambda: reached(records, 1, "0-") >= 7, [proc], 180, [log], "step 7")
        os.kill(pid_of(records, 1, "0-w2"), signal.SIGKILL)
        wait_until(lambda: reached(records, 0, "1-") >= 17, [proc], 180, [log],
                   "step 17 after the first restart")
        os.kill(pid_of(records, 0, "1-w2"), signal.SIGKILL)
        assert wait([proc], 240, [log]) == [0], tail([log])
    finally:
        stop(proc)
    check(tmp_path, "kill", reference)
    text = log.read_text()
    assert "restart 1 (torchrun): resuming from" in text
    assert "restart 2 (torchrun): resuming from" in text
    assert "step(s) lost" in text


@pytest.mark.slow
@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_resized_run_continues_the_same_order(tmp_path, reference, data, before, after):
    """Stop a run, relaunch it on another number of workers: same steps, same result."""
    name = f"resize{before}{after}"
    cfg = write_config(tmp_path, name, data=data)
    records, log = tmp_path / name / "records", tmp_path / f"{name}.log"
    proc = torchrun(single_node(before, cfg, restarts=0), log)
    try:
        wait_until(lambda: reached(records, 0) >= 8, [proc], 180, [log], "step 8")
    finally:
        stop(proc)  # the whole job, agent and workers, at once
    proc = torchrun(single_node(after, cfg, restarts=0), log)
    try:
        assert wait([proc], 240, [log]) == [0], tail([log])
    finally:
        stop(proc)
    check(tmp_path, name, reference)
    assert f"world size {before} -> {after}" in log.read_text()


@pytest.mark.slow
def test_a_joining_node_grows_the_group(tmp_path, reference, data):
    """A --nnodes=1:2 job runs on one agent; a second agent joins; it finishes on both."""
    cfg = write_config(tmp_path, "grow", data=data)
    records = tmp_path / "grow" / "records"
    logs = [tmp_path / "grow-a.log", tmp_path / "grow-b.log"]
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True,
                          wait_for_workers=False, timeout=datetime.timedelta(seconds=120))
    args = ["--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=3", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=grow", "--monitor-interval=0.1",
            "--rdzv-conf=is_host=false,last_call_timeout=1",
            "-m", "sailfin", "train", str(cfg), "--trainer.backend", "ddp"]
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    first = torchrun(args, logs[0], env)
    procs = [first]
    try:
        wait_until(lambda: reached(records, 0) >= 7, procs, 180, logs, "step 7 on one node")
        procs.append(torchrun(args, logs[1], env))
        assert wait(procs, 300, logs) == [0, 0], tail(logs)
    finally:
        stop(*procs)
        del store
    check(tmp_path, "grow", reference)
    assert "world size 1 -> 2" in logs[0].read_text() + logs[1].read_text()


@pytest.mark.slow
def test_a_worker_killed_during_a_save_resumes_from_the_previous_checkpoint(tmp_path,
                                                                           reference, data):
    cfg = write_config(tmp_path, "save", data=data)
    records, log = tmp_path / "save" / "records", tmp_path / "save.log"
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {"SAILFIN_TEST_SAVE_PAUSE": "60", "SAILFIN_TEST_SAVE_PAUSE_STEP": "9",
           "SAILFIN_TEST_SAVE_MARKER": str(markers)}
    proc = torchrun(single_node(2, cfg) + [
        "--trainer.checkpoint.class_path", "tests.checkpoint.helpers.SlowCheckpointer"],
        log, env)
    try:
        wait_until(lambda: (markers / "saving-9").exists(), [proc], 180, [log],
                   "the save of step 9")
        os.kill(pid_of(records, 0, "0-w2"), signal.SIGKILL)  # rank 0, before its commit
        assert wait([proc], 300, [log]) == [0], tail([log])
    finally:
        stop(proc)
    text = log.read_text()
    assert "restart 1 (torchrun): resuming from" in text and "step-00000006" in text
    check(tmp_path, "save", reference)
