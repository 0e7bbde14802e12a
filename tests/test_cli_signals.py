"""A SIGTERM that ends ``sailfin train`` says what it ended: before the first step, that
nothing was lost; after the loop began (torchrun stopping the job after a worker died,
while this rank stops on the error), the step reached, the error, and the steps lost."""

import signal

import pytest

from sailfin.cli import main
from sailfin.trainer.safety.preemption import Preemption
from tests.recipes import LinearRecipe

CONFIG = """
data: {class_path: tests.recipes.IdData, init_args: {n_train: 200, n_val: 4}}
module: {class_path: tests.test_cli_signals.PeerGone}
trainer: {epochs: 1, train_batch_size: 10, writers: [jsonl], output_dir: OUT,
          progress: none, checkpoint: {every_n_steps: EVERY}}
"""


class PeerGone(LinearRecipe):
    """Step 6 fails as a collective does when a partner process died."""

    def train_step(self, global_step, batch, device):
        if global_step == 5:
            raise RuntimeError("Connection closed by peer [127.0.0.1]:29500")
        return super().train_step(global_step, batch, device)


@pytest.fixture
def sigterm_after_the_loop_leaves(monkeypatch):
    """torchrun's SIGTERM lands while the rank stops on its error, after the loop's own
    handler has left (the moment the old message called 'set-up')."""
    uninstall = Preemption.uninstall

    def then_sigterm(self):
        uninstall(self)
        signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(Preemption, "uninstall", then_sigterm)


@pytest.mark.parametrize("every,lost", [
    (4, "the 1 step(s) after the last checkpoint (step-00000004) are lost; run the same "
        "command again to resume from it"),
    (50, "no checkpoint was saved: the 5 step(s) trained are lost; run the same command "
         "again to start over")])
def test_a_sigterm_after_steps_says_what_was_lost(tmp_path, capsys,
                                                   sigterm_after_the_loop_leaves, every, lost):
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG.replace("OUT", str(tmp_path / "out")).replace("EVERY", str(every)))
    assert main(["train", str(path)]) == 75
    err = capsys.readouterr().err
    assert "during set-up" not in err and "nothing was lost" not in err
    assert (f"sailfin: stopped by SIGTERM at step 5, while stopping after RuntimeError: "
            f"Connection closed by peer [127.0.0.1]:29500; {lost} (exit code 75)") in err
    saved = sorted(p.name for p in (tmp_path / "out" / "checkpoints").glob("step-*")) \
        if every == 4 else []
    assert saved == (["step-00000004"] if every == 4 else [])


class SwallowsAStop(LinearRecipe):
    """Set-up code with a bare ``except:`` (dill's import has one) around the moment a
    SIGTERM lands: then it fails on the half-done work, or goes on as if nothing came."""

    def __init__(self, data, then: str = "goes on") -> None:
        super().__init__(data)
        try:
            signal.raise_signal(signal.SIGTERM)
        except:  # noqa: E722
            pass
        if then == "fails":
            raise AttributeError("partially initialized module 'torch' has no attribute "
                                 "'distributed' (most likely due to a circular import)")


@pytest.mark.parametrize("then", ["fails", "goes on"])
def test_a_stop_that_set_up_code_swallowed_still_ends_the_run_with_one_line_and_75(
        tmp_path, capsys, then):
    out = tmp_path / "out"
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG.replace("OUT", str(out)).replace("EVERY", "1").replace(
        "tests.test_cli_signals.PeerGone", "tests.test_cli_signals.SwallowsAStop, "
        f"init_args: {{then: {then}}}"))
    assert main(["train", str(path)]) == 75
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["sailfin: stopped by SIGTERM during set-up, before the first step; nothing "
                   "was lost: run the same command again to start (or resume) (exit code "
                   "75)"], err
    assert not list(out.glob("checkpoints/step-*"))  # not one step trained (it saves each)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # in-process: put back


# The sailfin command (its own process: stop_at_start's handler under set-up's) with
# torchrun's SIGTERM landing after the loop's handler left, or while the trainer closes.
COMMAND = """
import signal, sys
from sailfin.trainer.compose.trainer import Trainer
from sailfin.trainer.safety.preemption import Preemption
cls, name = (Preemption, "uninstall") if sys.argv[1] == "loop-left" else (Trainer, "close")
original = getattr(cls, name)
def then_sigterm(self):
    if name == "uninstall":
        original(self)
    signal.raise_signal(signal.SIGTERM)
    if name == "close":
        original(self)
setattr(cls, name, then_sigterm)
from sailfin.cli import command
sys.argv = ["sailfin", "train", sys.argv[2]]
sys.exit(command())
"""


@pytest.mark.parametrize("when,said", [
    ("loop-left", "sailfin: stopped by SIGTERM at step 5, while stopping after RuntimeError: "
                  "Connection closed by peer [127.0.0.1]:29500; the 1 step(s) after the last "
                  "checkpoint (step-00000004) are lost"),
    ("closing", "sailfin: stopped by SIGTERM after training had begun, as the run was ending; "
                "the checkpoints saved are intact")])
def test_the_sailfin_command_never_calls_a_stop_after_steps_set_up(tmp_path, when, said):
    """Under torchrun, kill -9 of rank 1 after step 80: the surviving rank, which had logged
    step 80, printed 'stopped by SIGTERM during set-up, before the first step; nothing was
    lost'. The command's start handler (under set-up's) knew no training had begun."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG.replace("OUT", str(tmp_path / "out")).replace("EVERY", "4"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", COMMAND, when, str(path)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 75, proc.stderr
    assert "during set-up" not in proc.stderr and "nothing was lost" not in proc.stderr
    assert said in proc.stderr, proc.stderr
