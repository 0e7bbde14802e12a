"""A trainer whose set-up fails stops what set-up started: the hang watchdog (which runs
from the process group's first collective, so with several ranks from inside set-up) and
the run lock, whether set-up was called by itself or by train()."""

import threading

import pytest
import torch

from sailfin import Trainer
from sailfin.backends import Precision, SingleDevice
from sailfin.distributed import DistEnv
from tests.recipes import IdData, LinearRecipe, args


class NoOptimizer(LinearRecipe):
    """Fails in set-up after the watchdog has started (build_run: the optimizers)."""

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        raise RuntimeError("no optimizer today")


def watchdogs() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "sailfin-watchdog" and t.is_alive()]


def rank_of_two(tmp_path, rank: int, recipe=NoOptimizer) -> Trainer:
    dist = DistEnv(rank=rank, world_size=2)
    backend = SingleDevice(Precision(), torch.device("cpu"), dist)
    return Trainer(recipe(IdData(20, 0)), args(tmp_path), dist=dist, backend=backend)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("call", ["setup", "train"])
def test_a_failed_set_up_leaves_no_watchdog_and_no_lock(tmp_path, rank, call):
    trainer = rank_of_two(tmp_path, rank)
    started = []
    original = trainer.backend.setup

    def spy(module):  # set-up is past its first steps: the watchdog starts right after
        started.append(True)
        return original(module)

    trainer.backend.setup = spy
    with pytest.raises(RuntimeError, match="no optimizer today"):
        getattr(trainer, call)()
    assert started
    assert trainer.watchdog is None and not watchdogs()
    assert trainer._run_lock is None  # rank 0 held it: let go
    # The directory is free again: another run (rank 0, which locks) sets up there.
    again = rank_of_two(tmp_path, 0, recipe=LinearRecipe)
    again.setup()
    again.close()


def test_the_watchdog_does_run_during_set_up(tmp_path, monkeypatch):
    """The test above would pass with no watchdog at all: see it alive inside set-up."""
    import sailfin.trainer.compose.setup as compose_setup

    seen = []
    build = compose_setup.build_watchdog

    def spy(*a, **kw):
        dog = build(*a, **kw)
        seen.append(dog)
        return dog

    monkeypatch.setattr(compose_setup, "build_watchdog", spy)
    trainer = rank_of_two(tmp_path, 1)
    trainer.module.get_optimizers_schedulers = lambda *a: seen.append(len(watchdogs())) or 1 / 0
    with pytest.raises(ZeroDivisionError):
        trainer.setup()
    assert seen[1:] == [1] and not watchdogs()
