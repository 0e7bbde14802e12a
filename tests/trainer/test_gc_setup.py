"""While a run is built, Python's cyclic garbage collector spares the objects that already
exist (each full collection would walk all of torch's); they are given back after, and a
program that froze objects itself is left as it was."""

import gc
import subprocess
import sys
import weakref

import pytest

import sailfin.trainer.compose.trainer as compose
from sailfin import Trainer
from tests.recipes import IdData, LinearRecipe, args


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture
def freeze_seen(monkeypatch):
    seen = []
    build = compose.build_run

    def spy(trainer):
        seen.append(gc.get_freeze_count())
        return build(trainer)

    monkeypatch.setattr(compose, "build_run", spy)
    return seen


def interpreter_frozen() -> int:
    """What a fresh interpreter's permanent generation holds: 0, but 375 on CPython 3.12.1
    (objects the interpreter froze itself, which are not a program's)."""
    done = subprocess.run([sys.executable, "-I", "-S", "-c",
                           "import gc; print(gc.get_freeze_count())"],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


def test_setup_spares_existing_objects_and_gives_them_back(tmp_path, freeze_seen):
    assert gc.get_freeze_count() in (0, interpreter_frozen())  # the program froze none
    garbage = Node()
    alive = weakref.ref(garbage)
    del garbage  # cyclic garbage made before the run
    Trainer(LinearRecipe(IdData(20, 0)), args(tmp_path)).train()
    assert freeze_seen[0] > 10_000  # everything alive when set-up began was spared
    assert gc.get_freeze_count() == 0  # and given back
    gc.collect()
    assert alive() is None  # garbage from before the run is collected as ever


def test_a_program_that_froze_objects_itself_is_left_as_it_was(tmp_path, freeze_seen):
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        Trainer(LinearRecipe(IdData(20, 0)), args(tmp_path)).train()
        # Still frozen (a frozen object freed by reference counting leaves the count).
        assert 0.99 * frozen < freeze_seen[0] <= frozen
        assert 0.99 * frozen < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def test_a_failing_set_up_gives_the_objects_back(tmp_path, monkeypatch):
    def broken(trainer):
        raise RuntimeError("no optimizer")

    monkeypatch.setattr(compose, "build_run", broken)
    with pytest.raises(RuntimeError):
        Trainer(LinearRecipe(IdData(20, 0)), args(tmp_path)).train()
    assert gc.get_freeze_count() == 0


def test_objects_the_interpreter_froze_are_not_the_programs():
    """CPython 3.12 starts with objects in its permanent generation; sailfin must not read
    them as a program's own gc.freeze() (it would then never spare a run's objects)."""
    from sailfin.compat.python import frozen_at_start, program_froze_objects

    assert frozen_at_start() == interpreter_frozen()
    gc.freeze()
    try:
        assert program_froze_objects()
    finally:
        gc.unfreeze()
    assert not program_froze_objects()
