"""The compile check: the verdict from step times (a fake clock: it cannot flake), which
steps run eagerly, and that it is added only with trainer.compile on."""

import logging
from types import SimpleNamespace

import pytest
import torch

from sailfin import Trainer
from sailfin.trainer.features.speed_checks import CompileCheck, compile_verdict
from sailfin.trainer.features.loop_features import build_observers
from sailfin.distributed import DistEnv
from tests.recipes import IdData, LinearRecipe, args


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def run(check, clock, steps, step_seconds, start=0):
    """Drive the callback as the trainer does; step_seconds(step, eager) -> duration."""
    trainer = SimpleNamespace(global_step=start, device=torch.device("cpu"),
                              dist=SimpleNamespace(is_main=True))
    check.on_train_start(trainer)
    modes = {}
    for step in range(start + 1, steps + 1):
        modes[step] = check.eager
        clock.now += step_seconds(step, check.eager)
        trainer.global_step = step
        check.on_step_end(trainer)
    check.on_train_end(trainer)
    return modes


@pytest.mark.parametrize("compiled_s,eager_s,pays", [(0.010, 0.012, True),
                                                     (0.012, 0.010, False)])
def test_verdict_from_step_times(caplog, compiled_s, eager_s, pays):
    clock, stances = FakeClock(), []
    check = CompileCheck(warmup=3, window=2, clock=clock, stance=stances.append)
    with caplog.at_level(logging.INFO, logger="sailfin"):
        modes = run(check, clock, 20, lambda s, eager: 5.0 if s == 1 else
                    (eager_s if eager else compiled_s))
    assert [s for s, eager in modes.items() if eager] == [6, 7]  # (3 + 2, 3 + 4]
    assert stances == [True, False]  # once in, once out
    assert check.verdict[0] is pays
    message = check.verdict[1]
    assert f"{compiled_s * 1000:.2f} ms" in message and f"{eager_s * 1000:.2f} ms" in message
    assert "first step (compilation) took 5.0 s" in message
    record = [r for r in caplog.records if r.name == "sailfin"][-1]
    if pays:
        assert record.levelno == logging.INFO and "1.20x faster" in message
        assert "pays for itself after ~2500 steps" in message
    else:
        assert record.levelno == logging.WARNING and "does not pay" in message
        assert "0.83x" in message and "trainer.compile: false" in message


def test_one_slow_step_does_not_decide(caplog):
    """Medians: a checkpoint or log step inside a window does not flip the verdict."""
    clock = FakeClock()
    check = CompileCheck(warmup=2, window=3, clock=clock, stance=lambda eager: None)
    run(check, clock, 12, lambda s, eager: 1.0 if s == 4 else (0.02 if eager else 0.01))
    assert check.verdict[0] is True


def test_a_resumed_run_takes_the_same_steps_eagerly():
    clock, stances = FakeClock(), []
    check = CompileCheck(warmup=3, window=2, clock=clock, stance=stances.append)
    modes = run(check, clock, 12, lambda s, eager: 0.01, start=6)  # resumed after step 6
    assert [s for s, eager in modes.items() if eager] == [7]
    assert stances == [True, False]
    assert check.verdict is None  # no whole measurement in this process: no claim


def test_short_runs_and_compile_off_say_nothing():
    assert compile_verdict([0.01], [0.01], None)[0] is True
    clock = FakeClock()
    check = CompileCheck(warmup=8, window=4, clock=clock, stance=lambda eager: None)
    run(check, clock, 10, lambda s, eager: 0.01)
    assert check.verdict is None
    off = build_observers(args("/tmp/unused", writers=[], progress="none"), DistEnv(), writers=[])
    assert not any(isinstance(c, CompileCheck) for c in off.callbacks)
    on = build_observers(args("/tmp/unused", writers=[], progress="none", compile=True),
                         DistEnv(), writers=[])
    assert any(isinstance(c, CompileCheck) for c in on.callbacks)
    unchecked = build_observers(args("/tmp/unused", writers=[], progress="none", compile=True,
                                     compile_check=False), DistEnv(), writers=[])
    assert not any(isinstance(c, CompileCheck) for c in unchecked.callbacks)


def test_eager_stance_restores_the_previous_one():
    from sailfin.trainer.features.speed_checks import EagerStance
    from torch._dynamo import eval_frame

    before = eval_frame._stance.stance
    stance = EagerStance()
    stance(True)
    assert eval_frame._stance.stance == "force_eager"
    stance(False)
    assert eval_frame._stance.stance == before


def test_trainer_with_compile_runs_the_check(tmp_path, monkeypatch, caplog):
    from sailfin.backends import strategy as strategy_module

    monkeypatch.setattr(strategy_module, "compile_in_place",
                        lambda runner, mode: runner.compile(backend="aot_eager"))
    monkeypatch.setattr("sailfin.trainer.features.speed_checks.WARMUP_STEPS", 2)
    monkeypatch.setattr("sailfin.trainer.features.speed_checks.WINDOW_STEPS", 2)
    module = LinearRecipe(IdData(100, 0))
    trainer = Trainer(module, args(tmp_path, train_batch_size=10, compile=True, device="cpu"))
    with caplog.at_level(logging.INFO, logger="sailfin"):
        trainer.train()
    check = next(c for c in trainer.callbacks if isinstance(c, CompileCheck))
    assert check.verdict is not None and check.eager is False
    assert any("torch.compile" in r.getMessage() for r in caplog.records)
