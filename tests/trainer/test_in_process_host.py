"""sailfin used in-process (a notebook, a test) never ends its host process: a hang raises
``HangDetected``, a stop during set-up raises or returns 75 and leaves no thread that
could end the process later; handlers and threads are put back (tests/conftest.py's
autouse fixture fails any test that leaves one behind)."""

import signal
import time

import pytest

from sailfin import Trainer, signals
from sailfin.cli import main
from sailfin.config.distributed import DistArguments
from sailfin.distributed.watchdog import HangDetected
from tests.recipes import IdData, LinearRecipe, args


class StuckAtStep3(LinearRecipe):
    """Step 3 stops making progress (in Python: sleeping, as a stuck loader would)."""

    def train_step(self, global_step, batch, device):
        if global_step == 2:
            for _ in range(600):  # 30 s at most
                time.sleep(0.05)
        return super().train_step(global_step, batch, device)


def test_a_hang_in_process_raises_instead_of_ending_the_host(tmp_path):
    a = args(tmp_path, distributed=DistArguments(hang_seconds=1.0))
    module = StuckAtStep3(IdData(n_train=100, n_val=0))
    start = time.monotonic()
    with Trainer(module, a) as trainer:
        with pytest.raises(HangDetected, match="the sailfin command would exit 75 here"):
            trainer.train()
    assert time.monotonic() - start < 25  # not the 30 s the step would take
    assert trainer.watchdog is None  # stopped: no thread left (the autouse fixture checks)


class SetUpUnwindsSlowly(LinearRecipe):
    """SIGTERM arrives while the recipe is built, and its clean-up takes a while."""

    def __init__(self, *a, **kw):
        try:
            signal.raise_signal(signal.SIGTERM)
        finally:
            time.sleep(1.0)  # longer than STUCK_SECONDS below
        super().__init__(*a, **kw)


def test_a_stop_during_set_up_in_process_returns_75_and_leaves_the_host_alone(
        tmp_path, monkeypatch, capsys):
    # In a process of its own a set-up still stuck this long after the stop ends with 75;
    # in-process that would end pytest itself (the suite's exit 75 with no summary).
    monkeypatch.setattr(signals, "STUCK_SECONDS", 0.2)
    path = tmp_path / "run.yaml"
    path.write_text("data: {class_path: tests.recipes.IdData}\n"
                    "module: {class_path: tests.trainer.test_in_process_host.SetUpUnwindsSlowly}\n"
                    f"trainer: {{output_dir: {tmp_path / 'out'}, writers: [jsonl]}}\n")
    before = signal.getsignal(signal.SIGTERM)
    assert main(["train", str(path)]) == 75
    assert "stopped by SIGTERM during set-up" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == before  # the host's handler, back


def test_a_trainer_set_up_and_left_leaves_no_watchdog_running(tmp_path):
    """setup() by itself as rank 1 of 2 (what a resume test does): the watchdog that
    watched set-up's collectives (300 s under hang_seconds auto) stops when setup()
    returns. Left running, it ended the test process with 75 five minutes later."""
    import threading

    import torch

    from sailfin.backends import Precision, SingleDevice
    from sailfin.distributed import DistEnv

    dist = DistEnv(rank=1, world_size=2)
    backend = SingleDevice(Precision(), torch.device("cpu"), dist)
    trainer = Trainer(LinearRecipe(IdData(20, 0)), args(tmp_path), dist=dist, backend=backend)
    trainer.setup()
    assert trainer.watchdog is None
    assert not [t for t in threading.enumerate() if t.name == "sailfin-watchdog"]
