"""The time account: components that sum to the wall time, no replay or restart gap
without failures, and observing it never changes the weights."""

import json
import threading
import time

import pytest
import torch

from sailfin import Callback, Trainer
from sailfin.logging.time_account_file import COMPONENTS
from sailfin.logging import Writer
from sailfin.logging.files import JsonlWriter
from sailfin.trainer.compose import setup
from tests.checkpoint.helpers import SlowLinear
from tests.recipes import IdData, LinearRecipe, args


class Totals(Writer):
    def __init__(self):
        self.seen = []

    def log_run_totals(self, totals, step, epoch):
        self.seen.append((step, dict(totals)))


def train(out, writers=None, **kw):
    module = SlowLinear(IdData(200, 20), momentum=0.9, dropout=0.2, step_seconds=0.01)
    trainer = Trainer(module, args(out, epochs=2, checkpoint={"every_n_steps": 7},
                                   val_every_n_epochs=1, **kw), writers=writers)
    summary = trainer.train()
    trainer.close()
    return summary, {k: v.clone() for k, v in module.state_dict().items()}


def test_a_run_without_failures_has_no_replay_and_no_restart_gap(tmp_path):
    seen = Totals()
    summary, _ = train(tmp_path / "run", writers=[JsonlWriter(str(tmp_path / "run" /
                                                                   "metrics.jsonl")), seen])
    seen = seen.seen
    totals = summary["time_account"]
    seconds = totals["seconds"]
    assert set(seconds) == set(COMPONENTS)
    assert totals["segments"] == 1 and totals["failures"] == 0
    assert seconds["replayed"] == 0 and seconds["restart_gap"] == 0
    assert abs(sum(seconds.values()) - totals["wall_seconds"]) < 1e-3
    # 40 steps of >= 10 ms each: at least 0.4 s productive; saves and validation measured.
    assert seconds["productive"] >= 0.4
    assert seconds["checkpoint"] > 0 and seconds["validation"] > 0
    assert abs(totals["goodput"] - seconds["productive"] / totals["wall_seconds"]) < 1e-3
    # The file and summary.json say the same; the writers got the totals.
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())["time_account"]
    assert on_disk == totals
    account = json.loads((tmp_path / "run" / "time_account.json").read_text())
    assert account["segments"][0]["ended"] == "finished"
    assert seen == [(40, {"goodput": totals["goodput"], "wall_seconds": totals["wall_seconds"],
                          "restarts": 0, **{f"{k}_seconds": v for k, v in seconds.items()}})]


def test_observing_the_time_never_changes_the_weights(tmp_path, monkeypatch):
    _, with_account = train(tmp_path / "with")

    class Off(Callback):  # the same run with no account at all
        def __init__(self, *a, **k):
            pass

    monkeypatch.setattr(setup, "TimeAccount", Off)
    summary, without = train(tmp_path / "without")
    assert "time_account" not in summary
    assert not (tmp_path / "without" / "time_account.json").exists()
    for key in with_account:
        assert torch.equal(with_account[key], without[key]), key


class Crash(Exception):
    pass


def test_steps_lost_before_the_first_save_are_replayed_not_a_restart_gap(tmp_path):
    """Killed before any save: the next start trains from step 0 again; the lost steps'
    time (at the step time the new start measures) is replayed, the rest is the gap."""

    class CrashAt(Callback):
        def on_step_end(self, trainer):
            if trainer.global_step == 10:
                raise Crash()

    kw = dict(epochs=1, checkpoint={"every_n_steps": 15})
    with pytest.raises(Crash):
        Trainer(SlowLinear(IdData(200, 0), step_seconds=0.02), args(tmp_path, **kw),
                callbacks=[CrashAt()]).train()
    Trainer(SlowLinear(IdData(200, 0), step_seconds=0.02), args(tmp_path, **kw)).train()
    first, second = json.loads((tmp_path / "time_account.json").read_text())["segments"]
    assert (first["step"], second["from_step"], second["failure"]) == (0, 0, True)
    step_time = second["seconds"]["productive"] / 20
    assert step_time >= 0.02
    # 10 steps logged, then lost: 10 step times moved out of the gap.
    assert first["replayed_estimated"] == pytest.approx(10 * step_time, rel=0.25)
    assert first["seconds"]["replayed"] == first["replayed_estimated"]
    assert "unaccounted_steps" not in second


def test_a_process_start_is_read_from_the_system(tmp_path):
    """Start-up counts from the process's (under torchrun's first round: the launcher's)
    start, which /proc gives to 10 ms."""
    import subprocess
    import sys
    import time

    from sailfin.logging.time_account_file import process_start_time

    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        after = time.time()
        assert before - 0.05 <= process_start_time(child.pid) <= after + 0.05
    finally:
        child.kill()
        child.wait()


def test_max_steps_inside_an_epoch_counts_every_trained_step(tmp_path):
    """max_steps 30 ends the run 30 steps into a 100-step epoch, after the account's last
    write (at the start): each of those steps is productive time, not 'other'."""
    module = SlowLinear(IdData(1000, 0), step_seconds=0.02)
    trainer = Trainer(module, args(tmp_path / "run", epochs=1, max_steps=30,
                                   checkpoint={"every_n_steps": 1000}))
    summary = trainer.train()
    trainer.close()
    seconds = summary["time_account"]["seconds"]
    assert summary["global_step"] == 30
    # 30 steps of >= 20 ms each: at least 0.6 s trained, all of it productive.
    assert seconds["productive"] >= 0.6, seconds
    assert seconds["productive"] > seconds["other"], seconds


class SlowData(IdData):
    """Each sample takes ``seconds`` to read: the loop waits for its micro-batches."""

    def __init__(self, n: int, seconds: float, spent: list) -> None:
        super().__init__(n, 0)
        self.train = SlowSamples(self.train, seconds, spent)


class SlowSamples(torch.utils.data.Dataset):
    def __init__(self, inner, seconds, spent):
        self.inner, self.seconds, self.spent = inner, seconds, spent

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        started = time.perf_counter()
        time.sleep(self.seconds)
        self.spent.append(time.perf_counter() - started)  # as long as it really took
        return self.inner[i]


class SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds, spent):
        ctx.seconds, ctx.spent = seconds, spent
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        started = time.perf_counter()
        time.sleep(ctx.seconds)
        ctx.spent.append(time.perf_counter() - started)
        return grad, None, None


class SlowBackward(LinearRecipe):
    """Each micro-batch's forward takes ``seconds``, its backward twice that; ``spent``
    holds how long they really took (a loaded machine's sleeps run long)."""

    def __init__(self, data, seconds: float, spent: list) -> None:
        super().__init__(data)
        self.seconds, self.spent = seconds, spent

    def train_step(self, global_step, batch, device):
        started = time.perf_counter()
        time.sleep(self.seconds)
        self.spent.append(time.perf_counter() - started)
        loss, stats = super().train_step(global_step, batch, device)
        return SleepInBackward.apply(loss, 2 * self.seconds, self.spent), stats


class Reset(Callback):
    """Counts only what the loop does: reads before the first step (the start-up checks')
    are forgotten."""

    def __init__(self, *spent):
        self.spent = spent

    def on_train_start(self, trainer):
        for times in self.spent:
            times.clear()


@pytest.mark.parametrize("micro", [4, 8])
def test_data_wait_is_the_loops_time_in_next_batches_and_nothing_else(tmp_path, micro):
    """10 steps of 8 samples, each sample 2.5 ms to read (20 ms of reading per step), each
    micro-batch's forward 5 ms and backward 10 ms: the data wait holds the reading and
    none of the forwards or backwards (with 2 micro-batches a step, the wait for the
    second starts after the first's backward), which are productive."""
    reading, computing = [], []
    module = SlowBackward(SlowData(80, 0.0025, reading), 0.005, computing)
    trainer = Trainer(module, args(tmp_path / "run", train_batch_size=8, micro_batch_size=micro,
                                   checkpoint={"at_epoch_end": False}),
                      callbacks=[Reset(reading, computing)])
    summary = trainer.train()
    trainer.close()
    seconds = summary["time_account"]["seconds"]
    assert len(reading) == 80 and len(computing) == 2 * 10 * 8 // micro
    read, computed = sum(reading), sum(computing)
    # Every read happens inside next(batches); no forward or backward does.
    assert read <= seconds["data_wait"] + 1e-4 < read + computed / 2, (read, computed, seconds)
    assert seconds["productive"] >= computed, (computed, seconds)
    # The loop's own counter, which the account reads, holds the same wait.
    assert trainer.data_seconds == pytest.approx(seconds["data_wait"], abs=1e-4)  # rounded


def test_no_thread_runs_beside_the_loop(tmp_path):
    """The time account measures on the loop's own clock: training starts no thread (the
    hang watchdog, off here, is the one that may)."""
    before = set(threading.enumerate())  # (a thread an earlier test left is not the run's)
    seen = []

    class Threads(Callback):
        def on_step_end(self, trainer):
            seen.append([t.name for t in threading.enumerate() if t not in before])

    Trainer(LinearRecipe(IdData(40, 0)), args(tmp_path), callbacks=[Threads()]).train()
    assert len(seen) == 4 and not any(seen), seen
