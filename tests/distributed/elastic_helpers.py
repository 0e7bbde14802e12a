"""Launching, watching and killing torchrun jobs for the elastic tests and benchmark."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Optional

from tests.distributed.elastic_recipe import write_id_shards
from tests.distributed.harness import kill_tree

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """
data: {class_path: tests.recipes.IdData, init_args: {n_train: 96, n_val: 10}}
module:
  class_path: tests.distributed.elastic_recipe.ElasticRecipe
  init_args: {out: RECORDS, step_seconds: STEP_SECONDS, lr: 0.05, momentum: 0.9}
trainer:
  epochs: 2
  train_batch_size: 8          # 12 steps an epoch; accumulation 4, 2 or 1 on 1, 2 or 4 ranks
  micro_batch_size: 2
  writers: [jsonl]
  log_every_n_steps: 1
  output_dir: RUN
  seed: 5
  checkpoint: {every_n_steps: EVERY}
  distributed: {timeout_seconds: 60}
"""
STEPS_PER_EPOCH, EPOCHS = 12, 2


def write_config(tmp: Path, name: str, every: int = 3, step_seconds: float = 0.15,
                 data: str = "map", epochs: int = EPOCHS) -> Path:
    """A run's config; ``data="shards"`` streams the same samples from uneven tar shards."""
    path = tmp / f"{name}.yaml"
    text = (CONFIG.replace("RECORDS", str(tmp / name / "records"))
            .replace("epochs: 2", f"epochs: {epochs}")
            .replace("RUN", str(tmp / name / "run"))
            .replace("STEP_SECONDS", str(step_seconds)).replace("EVERY", str(every)))
    if data == "shards":
        shards = tmp / name / "shards"
        write_id_shards(str(shards))
        text = text.replace(
            "{class_path: tests.recipes.IdData, init_args: {n_train: 96, n_val: 10}}",
            "{class_path: tests.distributed.elastic_recipe.ShardIdData, "
            f"init_args: {{shards: '{shards}/shard-*.tar', n_val: 10}}}}")
        assert "ShardIdData" in text
    path.write_text(text)
    return path


def torchrun(args: list[str], log: Path, env: Optional[dict] = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    fh = open(log, "ab")
    try:
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args],
                                env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
    finally:
        fh.close()


def single_node(nproc: int, config: Path, restarts: int = 3) -> list[str]:
    return ["--nnodes=1", f"--nproc-per-node={nproc}", f"--max-restarts={restarts}",
            "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "--monitor-interval=0.1",
            "-m", "sailfin", "train", str(config), "--trainer.backend", "ddp"]


def stop(*procs: subprocess.Popen) -> None:
    """SIGKILL each job: its agent and every worker under it."""
    for p in procs:
        kill_tree(p)


def wait(procs: list[subprocess.Popen], timeout: float, logs: list[Path]) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        stop(*procs)
        raise AssertionError("torchrun did not finish in time:\n" + tail(logs))
    return [p.returncode for p in procs]


def tail(logs: list[Path], chars: int = 4000) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-chars:]}"
                     for log in logs if log.exists())


def records(records_dir: Path) -> list[dict]:
    out = []
    for path in sorted(records_dir.glob("steps-*.jsonl")):
        rank = int(path.name.split("-")[1][4:])
        for line in path.read_text().splitlines():
            if line.endswith("}"):
                out.append({**json.loads(line), "rank": rank, "file": path.name})
    return out


def reached(records_dir: Path, rank: int, attempt_prefix: str = "") -> int:
    """The highest step a rank has finished in rounds whose key starts with the prefix."""
    steps = [r["step"] for r in records(records_dir)
             if r["rank"] == rank and r["attempt"].startswith(attempt_prefix)]
    return max(steps, default=0)


def wait_until(condition: Callable[[], bool], procs: list[subprocess.Popen], timeout: float,
               logs: list[Path], what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"the job ended before {what}:\n" + tail(logs))
        if time.monotonic() > deadline:
            stop(*procs)
            raise AssertionError(f"timed out waiting for {what}:\n" + tail(logs))
        time.sleep(0.05)


def pid_of(records_dir: Path, rank: int, attempt: str) -> int:
    [path] = records_dir.glob(f"pid-rank{rank}-{attempt}-pid*")
    return int(path.read_text())


def final_steps(records_dir: Path) -> dict[int, list[int]]:
    """Step -> sorted sample ids, from the LAST execution of each step (all its ranks)."""
    by_step: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    last_time: dict[int, dict[str, float]] = defaultdict(dict)
    for r in records(records_dir):
        by_step[r["step"]][r["attempt"]].extend(r["ids"])
        last_time[r["step"]][r["attempt"]] = max(r["time"],
                                                 last_time[r["step"]].get(r["attempt"], 0))
    out = {}
    for step, attempts in by_step.items():
        latest = max(attempts, key=lambda a: last_time[step][a])
        out[step] = sorted(attempts[latest])
    return out


def all_executions(records_dir: Path) -> dict[int, list[list[int]]]:
    """Step -> the sorted ids of each round that ran it (a re-run step must match)."""
    by_step: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in records(records_dir):
        by_step[r["step"]][r["attempt"]].extend(r["ids"])
    return {s: [sorted(v) for v in a.values()] for s, a in by_step.items()}
