"""SIGTERM and Ctrl-C: finish the step, save on every rank at the same step, stop; resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sailfin import Callback, Trainer
from sailfin.trainer.safety import preemption
from sailfin.trainer.safety.preemption import PREEMPTED_EXIT_CODE, TrainingPreempted
from tests.checkpoint.helpers import assert_same_params, final_weights, params
from tests.distributed.harness import errors, run_ranks
from tests.recipes import IdData, LinearRecipe, args

ROOT = Path(__file__).resolve().parents[2]


class SignalAt(Callback):
    """Sends this process ``signals`` after optimizer step ``step``."""

    def __init__(self, step: int, *signals: int) -> None:
        self.step, self.signals = step, signals

    def on_step_end(self, trainer) -> None:
        if trainer.global_step == self.step:
            for sig in self.signals:
                os.kill(os.getpid(), sig)


def run(tmp, callbacks=(), **kw):
    module = LinearRecipe(IdData(60, 6), dropout=0.2, momentum=0.9)
    trainer = Trainer(module, args(tmp, epochs=2, **kw), callbacks=list(callbacks))
    return module, trainer


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_the_step_and_stops_then_resume_is_bit_identical(tmp_path, sig, capfd):
    ref, trainer = run(tmp_path / "ref")
    trainer.train()
    module, trainer = run(tmp_path / "run", [SignalAt(4, sig)])
    with pytest.raises(TrainingPreempted) as info:
        trainer.train()
    name = signal.Signals(sig).name
    assert info.value.step == 4 and trainer.global_step == 4
    assert str(info.value).startswith(f"stopped by {name} after step 4; saved checkpoint ")
    assert f"sailfin: {name} received: stopping after this step" in capfd.readouterr().err
    root = tmp_path / "run" / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-00000004"  # saved without a trigger
    assert signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler)  # restored
    module, trainer = run(tmp_path / "run")
    trainer.train()
    assert trainer.resumed_from.name == "step-00000004"
    assert_same_params(params(ref), params(module))


def test_a_second_ctrl_c_aborts_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(preemption, "_SAME_PRESS_SECONDS", -1.0)
    module, trainer = run(tmp_path, [SignalAt(3, signal.SIGINT, signal.SIGINT)])
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert trainer.global_step == 3 and not (tmp_path / "checkpoints").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_loop_checks_one_integer_per_step_without_a_signal(tmp_path, monkeypatch):
    calls = []

    class Counting(preemption.Preemption):
        def poll(self, global_step):
            calls.append(global_step)
            return super().poll(global_step)

    monkeypatch.setattr("sailfin.trainer.compose.trainer.Preemption", Counting)
    run(tmp_path)[1].train()
    assert calls == []  # single process, no signal: poll() is never called


def preempted_rank(rank, world, dist_args, out, check_every):
    module = LinearRecipe(IdData(96, 0), momentum=0.9)
    a = args(out / "run", backend="ddp", distributed=dist_args, epochs=3,
             train_batch_size=8, micro_batch_size=4,
             preemption_check_every_n_steps=check_every)
    # The ranks get their signal at different steps, as under torchrun.
    with Trainer(module, a, callbacks=[SignalAt(2 + 3 * rank, signal.SIGTERM)]) as trainer:
        try:
            trainer.train()
        except TrainingPreempted as exc:
            (out / f"rank{rank}.json").write_text(json.dumps({
                "step": exc.step, "weight": module.linear.weight.tolist()}))


@pytest.mark.slow
def test_ranks_signalled_at_different_steps_save_the_same_step(tmp_path):
    codes = run_ranks(preempted_rank, 2, tmp_path, check_every=4)
    assert codes == [0, 0], errors(tmp_path)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # Rank 0 at step 2, rank 1 (not yet signalled) with it: both stop at step 4, the
    # first check after a signal on any rank.
    assert [r["step"] for r in results] == [4, 4]
    assert results[0]["weight"] == results[1]["weight"]
    root = tmp_path / "run" / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-00000004"
    manifest = json.loads((root / "step-00000004" / "manifest.json").read_text())
    assert set(manifest["sharded"]["entries"]) >= {"rng/rank00000", "rng/rank00001"}


CONFIG = """
data: {class_path: tests.recipes.IdData, init_args: {n_train: 47, n_val: 9}}
module:
  class_path: tests.checkpoint.helpers.SlowLinear
  init_args: {dropout: 0.3, momentum: 0.9, step_seconds: STEP}
trainer: {epochs: 6, train_batch_size: 10, micro_batch_size: 5, seed: 3, log_every_n_steps: 1,
          writers: [jsonl], output_dir: OUT}
"""


@pytest.mark.slow
def test_sigterm_to_sailfin_train_exits_75_with_a_line_and_resumes(tmp_path):
    from sailfin.cli import main

    ref = tmp_path / "ref.yaml"
    ref.write_text(CONFIG.replace("OUT", str(tmp_path / "ref")).replace("STEP", "0"))
    assert main(["train", str(ref)]) == 0
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG.replace("OUT", str(tmp_path / "run")).replace("STEP", "0.05"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "sailfin", "train", str(config)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 7):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == PREEMPTED_EXIT_CODE, err
    assert "Traceback" not in err
    line = [e for e in err.splitlines() if "stopped by SIGTERM" in e]
    assert len(line) == 1 and line[0].endswith(f"(exit code {PREEMPTED_EXIT_CODE})"), err
    step = int(line[0].split("after step ")[1].split(";")[0])
    latest = (tmp_path / "run" / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step-{step:08d}"
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"resuming from {tmp_path / 'run' / 'checkpoints' / latest}" in proc.stderr
    a, b = final_weights(tmp_path / "run"), final_weights(tmp_path / "ref")
    assert all(torch.equal(a[k], b[k]) for k in a)


LOUD_RUN = """
import sys
from pathlib import Path
from sailfin import Trainer
from tests.recipes import IdData, LinearRecipe, args

class Loud(LinearRecipe):
    def on_end_train_step(self, global_step, loss, stats):
        sys.stderr.write("x" * 20000 + "\\n")  # the pipe fills: this write blocks
        if global_step == 2:
            Path(sys.argv[2]).write_text("busy")

module = Loud(IdData(60, 6))
Trainer(module, args(sys.argv[1], epochs=10 ** 6, writers=[], progress="none")).train()
"""


def test_sigterm_during_a_blocked_log_write_still_saves(tmp_path):
    """(#28) The handler does no I/O: a SIGTERM landing inside a write to stderr (a full
    pipe) used to print from the handler, raise 'reentrant call' and end unsaved."""
    marker = tmp_path / "busy"
    proc = subprocess.Popen([sys.executable, "-c", LOUD_RUN, str(tmp_path / "out"), str(marker)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the child is now blocked writing to the unread pipe
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = err.decode(errors="replace")
    assert "reentrant" not in text, text[-2000:]
    assert "TrainingPreempted" in text and "SIGTERM received: stopping after this step" in text
    assert (tmp_path / "out" / "checkpoints" / "latest").exists(), text[-2000:]
