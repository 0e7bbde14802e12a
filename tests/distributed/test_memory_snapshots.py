"""Memory snapshots under torchrun on loopback: a worker SIGKILLed at random steps
resumes from the last or last-but-one step; a lost "node" (its snapshot directory
removed, its worker killed) comes back from the replica on the other node, or from
disk without one. Every run ends bit-identical to an uninterrupted run."""

from __future__ import annotations

import datetime
import json
import os
import random
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from sailfin.checkpoint import snapshot_dirs
from tests.distributed.elastic_helpers import (pid_of, reached, single_node, stop, tail,
                                               torchrun, wait, wait_until, write_config)
from tests.distributed.harness import free_port
from tests.distributed.test_elastic import TOTAL, check


def memory_config(tmp: Path, name: str, replicas: int = 0, step_seconds: float = 0.15) -> Path:
    """The elastic tests' run, with disk checkpoints every 6 steps and snapshots every step."""
    path = write_config(tmp, name, every=6, step_seconds=step_seconds)
    text = path.read_text().replace(
        "checkpoint: {every_n_steps: 6}",
        f"checkpoint: {{every_n_steps: 6, memory: {{every_n_steps: 1, replicas: {replicas}}}}}")
    assert "memory:" in text
    path.write_text(text)
    return path


def weights(tmp: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(tmp / name / "run" / "final" / "model.safetensors"))


def shm_dirs(tmp: Path, name: str) -> list[str]:
    prefix = f"sailfin-{snapshot_dirs.run_id(str(tmp / name / 'run'))}"
    return [e for e in os.listdir(snapshot_dirs.DEFAULT_PARENT) if e.startswith(prefix)]


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory):
    """The uninterrupted run on 2 ranks, with snapshots: its weights, its one-process twin."""
    tmp = tmp_path_factory.mktemp("memory-reference")
    log = tmp / "ref.log"
    proc = torchrun(single_node(2, memory_config(tmp, "ref", step_seconds=0), restarts=0), log)
    try:
        assert wait([proc], 240, [log]) == [0], tail([log])
    finally:
        stop(proc)
        snapshot_dirs.clean(str(tmp / "ref" / "run"))
    from sailfin.cli import main
    assert main(["train", str(write_config(tmp, "one", step_seconds=0))]) == 0
    from tests.distributed.elastic_helpers import final_steps
    one = load_file(str(tmp / "one" / "run" / "final" / "model.safetensors"))
    assert not shm_dirs(tmp, "ref")  # nothing left in /dev/shm after a normal end
    return weights(tmp, "ref"), (one, final_steps(tmp / "one" / "records"))


def same_bits(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs from the uninterrupted run"


@pytest.mark.slow
def test_workers_killed_at_random_steps_lose_at_most_one_step(tmp_path, ddp_reference):
    cfg = memory_config(tmp_path, "kill")
    records, log = tmp_path / "kill" / "records", tmp_path / "kill.log"
    seed = int(os.environ.get("SAILFIN_TEST_SEED") or time.time())  # a failure's seed reruns it
    rng = random.Random(seed)
    proc = torchrun(single_node(2, cfg, restarts=2), log)
    at_kill = []
    try:
        for attempt in range(2):
            target = reached(records, 0, f"{attempt}-") + rng.randint(3, 7)
            wait_until(lambda: reached(records, 0, f"{attempt}-") >= target, [proc], 180,
                       [log], f"step {target}")
            time.sleep(rng.uniform(0.0, 0.15))  # anywhere in a step, or in its snapshot
            victim = rng.randint(0, 1)
            # The last step every rank finished (the next may finish before the kill lands).
            at_kill.append(min(reached(records, r, f"{attempt}-") for r in (0, 1)))
            os.kill(pid_of(records, victim, f"{attempt}-w2"), signal.SIGKILL)
            wait_until(lambda: f"restart {attempt + 1} (torchrun): resuming" in log.read_text(),
                       [proc], 180, [log], f"restart {attempt + 1}")
        assert wait([proc], 300, [log]) == [0], tail([log])
    finally:
        stop(proc)
        snapshot_dirs.clean(str(tmp_path / "kill" / "run"))
    text = log.read_text()
    resumed = [int(s) for s in re.findall(r"\(torchrun\): resuming from \S+: step (\d+)", text)]
    assert len(resumed) == 2, (seed, tail([log]))
    # From memory, or from a disk checkpoint newer than every complete snapshot (a kill
    # right after a disk checkpoint's step, before that step's snapshot was complete, or
    # one step after a resume from disk, before the first snapshot since was).
    from_memory = len(re.findall(r"resuming from memory, step (\d+)", text))
    from_newer_disk = len(re.findall(r"is older than the disk checkpoint of step|memory "
                                     r"snapshots: none is held", text))
    said = [line for line in text.splitlines() if "sailfin:" in line and "[progress]" not in line]
    assert from_memory + from_newer_disk == 2, (seed, "\n".join(said))
    for step, finished in zip(resumed, at_kill):
        assert finished - 1 <= step <= finished + 1, (resumed, at_kill, seed)  # last or the one before
    weights_ref, one = ddp_reference
    same_bits(weights(tmp_path, "kill"), weights_ref)
    check(tmp_path, "kill", one)  # every sample once per epoch, step k on the same samples


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 0])
def test_a_lost_node_comes_back_from_the_replica(tmp_path, ddp_reference, replicas):
    name = f"node{replicas}"
    cfg = memory_config(tmp_path, name, replicas=replicas)
    records = tmp_path / name / "records"
    logs = [tmp_path / f"{name}-a.log", tmp_path / f"{name}-b.log"]
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True,
                          wait_for_workers=False, timeout=datetime.timedelta(seconds=120))
    args = ["--nnodes=2", "--nproc-per-node=1", "--max-restarts=2", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={name}", "--monitor-interval=0.1",
            "--rdzv-conf=is_host=false", "-m", "sailfin", "train", str(cfg),
            "--trainer.backend", "ddp"]
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    procs = [torchrun(args, logs[0], env), torchrun(args, logs[1], env)]
    run = str(tmp_path / name / "run")
    try:
        wait_until(lambda: reached(records, 1, "0-") >= 9, procs, 180, logs, "step 9")
        os.kill(pid_of(records, 1, "0-w2"), signal.SIGKILL)
        shutil.rmtree(snapshot_dirs.snapshot_root(None, run, 1))  # the node's memory is gone
        assert wait(procs, 300, logs) == [0, 0], tail(logs)
    finally:
        stop(*procs)
        snapshot_dirs.clean(run)
        del store
    text = logs[0].read_text() + logs[1].read_text()
    if replicas:
        assert re.search(r"resuming from memory, step \d+ \(held by every rank; rank 1 from "
                         r"the replica held by rank 0", text), tail(logs)
    else:
        assert "memory snapshots: no step is held for every rank (rank(s) 1 lack one: their " \
            "node's memory was lost and no replica holds it" in text
        assert re.search(r"resuming from disk step 6, \d+ step\(s\) behind", text), tail(logs)
    weights_ref, _ = ddp_reference
    same_bits(weights(tmp_path, name), weights_ref)
    # (The records' attempt keys cannot tell this run's rounds apart: an agent whose
    # worker did not fail keeps its restart count. The bits above say enough.)
    events = [json.loads(line) for line in
              (tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["split"] == "train"] == list(range(1, TOTAL + 1))
    assert not shm_dirs(tmp_path, name)


@pytest.mark.slow
def test_fsdp_ranks_snapshot_their_own_shards_and_resume_exactly(tmp_path):
    logs = {name: tmp_path / f"{name}.log" for name in ("ref", "kill")}
    fsdp = ["fsdp" if a == "ddp" else a for a in single_node(2, Path("X"), restarts=2)]
    procs = {}
    try:
        for name in ("ref", "kill"):
            cfg = memory_config(tmp_path, name, step_seconds=0 if name == "ref" else 0.15)
            procs[name] = torchrun([str(cfg) if a == "X" else a for a in fsdp], logs[name])
        records = tmp_path / "kill" / "records"
        wait_until(lambda: reached(records, 1, "0-") >= 8, [procs["kill"]], 180,
                   [logs["kill"]], "step 8")
        os.kill(pid_of(records, 1, "0-w2"), signal.SIGKILL)
        assert wait(list(procs.values()), 300, list(logs.values())) == [0, 0], \
            tail(list(logs.values()))
    finally:
        stop(*procs.values())
        for name in ("ref", "kill"):
            snapshot_dirs.clean(str(tmp_path / name / "run"))
    assert re.search(r"resuming from memory, step (7|8|9) ", logs["kill"].read_text()), \
        tail([logs["kill"]])
    same_bits(weights(tmp_path, "kill"), weights(tmp_path, "ref"))


_OBSERVED: dict = {}


def two_ranks(tmp: Path, backend: str, variant) -> dict:
    from tests.checkpoint.memory_observer import train_rank
    from tests.distributed.harness import errors, run_ranks

    tmp.mkdir(parents=True, exist_ok=True)
    assert run_ranks(train_rank, 2, tmp, timeout=240, backend=backend,
                     variant=variant) == [0, 0], errors(tmp)
    return torch.load(tmp / "result.pt", weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["every-step", "persisted", "async-save"])
@pytest.mark.parametrize("backend", ["ddp", "fsdp", "ddp-dp"])
def test_snapshots_leave_two_ranks_bit_identical(tmp_path_factory, backend, variant):
    """Observing never changes a run: 2 ranks with snapshots against 2 without, AdamW."""
    if backend not in _OBSERVED:
        _OBSERVED[backend] = two_ranks(tmp_path_factory.mktemp(f"ref-{backend}"), backend, None)
    want = _OBSERVED[backend]
    got = two_ranks(tmp_path_factory.mktemp(f"{backend}-{variant}"), backend, variant)
    assert want["steps"] == got["steps"] and len(got["steps"]) == 1
    same_bits(got["weights"], want["weights"])


@pytest.mark.slow
def test_ddp_writes_the_replicated_state_once_per_node(tmp_path):
    from tests.checkpoint.memory_observer import node_bytes_rank
    from tests.distributed.harness import errors, run_ranks

    assert run_ranks(node_bytes_rank, 2, tmp_path, timeout=240) == [0, 0], errors(tmp_path)
    seen = torch.load(tmp_path / "node-bytes.pt")
    assert len(seen) == 3  # steps 3, 4, 5
    for used, kept, state in seen:
        assert kept == 2  # the newest committed snapshot and the one before it
        assert state > 1 << 20  # model and AdamW's state: the random streams are small
        # Two buffer sets of one rank's state per node, nothing else: no staging copy, no
        # second copy, the other rank's sets hold only its random streams.
        assert used <= 1.1 * state * kept, (used, state, kept)


@pytest.mark.slow
def test_a_ddp_snapshot_resumes_onto_one_process(tmp_path, ddp_reference, capfd):
    """kill -9 a 2-rank ddp run; one process resumes from the node's copy in memory."""
    cfg = memory_config(tmp_path, "alone")
    records, log = tmp_path / "alone" / "records", tmp_path / "alone.log"
    proc = torchrun(single_node(2, cfg, restarts=0), log)
    try:
        wait_until(lambda: reached(records, 0, "0-") >= 7, [proc], 180, [log], "step 7")
        os.kill(pid_of(records, 1, "0-w2"), signal.SIGKILL)
        assert wait([proc], 120, [log]) != [0]
        from sailfin.cli import main
        capfd.readouterr()
        assert main(["train", str(cfg), "--trainer.backend", "sp"]) == 0
    finally:
        stop(proc)
        snapshot_dirs.clean(str(tmp_path / "alone" / "run"))
    err = capfd.readouterr().err
    step = re.search(r"resuming from memory, step (\d+) ", err)
    assert step and int(step.group(1)) >= 6, err[-3000:]
    assert "world size 2 -> 1" in err
    weights_ref, _ = ddp_reference
    got = weights(tmp_path, "alone")
    for key, value in weights_ref.items():  # another world size: the same up to rounding
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6)
    events = [json.loads(line) for line in
              (tmp_path / "alone" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["split"] == "train"] == list(range(1, TOTAL + 1))
