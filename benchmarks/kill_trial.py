"""Kill trial: SIGKILL ``sailfin train`` again and again, resume each time, compare bits.

A small recipe (47 samples, dropout, momentum, a step checkpoint every 3 steps,
``keep_last: 1``, each save pausing 0.15 s after its model file so that kills
land inside saves too) is trained once without interruption. Then each trial
starts the same run in a fresh directory and kills it with SIGKILL
``--kills`` times: half of the kills wait until a save is under way (a
marker file the checkpointer writes) and strike within its pause, the others
strike at a random moment after a checkpoint. After the last kill the run
goes to its end. The final weights and every metrics.jsonl line (but the
throughput figure) must equal the uninterrupted run's bit for bit.

    python benchmarks/kill_trial.py                       # 4 trials x 6 kills
    python benchmarks/kill_trial.py --trials 2 --kills 10 --seed 7

Prints kills (and how many inside a save), resumes, and trials bit-identical.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = """
data: {class_path: tests.recipes.IdData, init_args: {n_train: 47, n_val: 9}}
module:
  class_path: tests.checkpoint.helpers.SlowLinear
  init_args: {dropout: 0.3, momentum: 0.9, step_seconds: STEP_SECONDS}
trainer:
  epochs: 8
  train_batch_size: 10
  micro_batch_size: 5
  seed: 3
  log_every_n_steps: 1
  writers: [jsonl]
  output_dir: OUT
  checkpoint: {every_n_steps: 3, keep_last: 1,
               class_path: tests.checkpoint.helpers.SlowCheckpointer}
"""


def write_config(tmp: Path, name: str, step_seconds: float) -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(CONFIG.replace("OUT", str(tmp / name))
                    .replace("STEP_SECONDS", str(step_seconds)))
    return path


def start(config: Path, log: Path, env: dict) -> subprocess.Popen:
    with open(log, "ab") as fh:
        return subprocess.Popen([sys.executable, "-m", "sailfin", "train", str(config)],
                                cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def wait_until(predicate, proc: subprocess.Popen, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def latest_step(out: Path) -> int:
    try:
        return int((out / "checkpoints" / "latest").read_text().split("-")[1])
    except (FileNotFoundError, IndexError, ValueError):
        return -1


def trial(tmp: Path, name: str, kills: int, rng: random.Random, env: dict) -> dict:
    config, out, log = write_config(tmp, name, 0.03), tmp / name, tmp / f"{name}.log"
    markers = tmp / f"{name}-markers"
    markers.mkdir()
    env = {**env, "SAILFIN_TEST_SAVE_PAUSE": "0.15", "SAILFIN_TEST_SAVE_MARKER": str(markers)}
    done = {"kills": 0, "in_save": 0}
    while done["kills"] < kills:
        proc = start(config, log, env)
        try:
            if rng.random() < 0.5:  # inside a save: in the pause after its model file
                seen = set(os.listdir(markers))
                hit = wait_until(lambda: any(m.startswith("saving-") and m not in seen
                                             for m in os.listdir(markers)), proc)
                if hit:
                    time.sleep(rng.uniform(0.0, 0.12))
                    done["in_save"] += 1
            else:  # anywhere: past a new checkpoint, then a random moment
                before = latest_step(out)
                if wait_until(lambda: latest_step(out) > before, proc):
                    time.sleep(rng.uniform(0.0, 0.4))
            if proc.poll() is not None:
                break  # the run finished before this kill
            kill(proc)
            done["kills"] += 1
        finally:
            kill(proc)
    final = start(config, log, env)
    code = final.wait(timeout=600)
    text = log.read_text(errors="replace")
    done["resumes"] = len(re.findall(r"resuming from ", text))
    done["exit"] = code
    return done


def compare(out: Path, ref: Path) -> bool:
    from tests.checkpoint.helpers import final_weights, metric_lines

    try:
        a, b = final_weights(out), final_weights(ref)
    except FileNotFoundError:
        return False
    return (a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
            and metric_lines(out) == metric_lines(ref))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--kills", type=int, default=6, help="SIGKILLs per trial")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else int(time.time())
    rng = random.Random(seed)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="sailfin-kill-trial-") as tmp_name:
        tmp = Path(tmp_name)
        ref_config = write_config(tmp, "ref", 0.0)
        ref_log = tmp / "ref.log"
        if start(ref_config, ref_log, env).wait(timeout=600) != 0:
            print(ref_log.read_text(), file=sys.stderr)
            return 1
        totals = {"kills": 0, "in_save": 0, "resumes": 0, "identical": 0}
        for t in range(args.trials):
            result = trial(tmp, f"trial{t}", args.kills, rng, env)
            same = result["exit"] == 0 and compare(tmp / f"trial{t}", tmp / "ref")
            print(f"trial {t}: {result['kills']} kills ({result['in_save']} inside a save), "
                  f"{result['resumes']} resumes, final exit {result['exit']}, "
                  f"{'bit-identical' if same else 'DIFFERENT'}", flush=True)
            if not same:
                print((tmp / f"trial{t}.log").read_text(errors="replace")[-4000:],
                      file=sys.stderr)
            totals["kills"] += result["kills"]
            totals["in_save"] += result["in_save"]
            totals["resumes"] += result["resumes"]
            totals["identical"] += same
    print(f"seed {seed}: {totals['kills']} SIGKILLs ({totals['in_save']} inside saves), "
          f"{totals['resumes']} resumes, {totals['identical']}/{args.trials} trials "
          "bit-identical to the uninterrupted run (weights and metrics.jsonl)")
    return 0 if totals["identical"] == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
