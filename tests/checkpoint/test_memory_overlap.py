"""A memory snapshot copies the parameters and the optimizer's state while the next
forward and backward run; the optimizer step waits for that copy, and a snapshot whose
sources changed meanwhile (a forward that renormalises its weights in place) is dropped,
never committed, and the rest of the run copies at once."""

import collections
import os
import random
import threading

import pytest
import torch
from torch import nn

from sailfin import Callback, Trainer
from sailfin.checkpoint import snapshot_sets
from sailfin.checkpoint.snapshots import SnapshotStore
from sailfin.trainer.checkpointing.memory_snapshots import snapshots_of
from tests.checkpoint.helpers import Crash, CrashAt
from tests.checkpoint.test_memory import Settle, facts
from tests.recipes import IdData, LinearRecipe, args as make_args


def key(tensor):
    return (tensor.untyped_storage().data_ptr(), str(tensor.device))


def held(store, step):
    return store.load(store.inventory()[0][step])[1]


def test_the_named_storages_are_copied_in_a_thread_and_a_change_drops_the_snapshot(tmp_path):
    store = SnapshotStore(str(tmp_path / "shm"), rank=0, world_size=1)
    weight, buffer = torch.arange(1000.0), torch.zeros(3)
    state = {"model": {"w": weight, "b": buffer}, "trainer": {}}
    assert store.take(1, facts(1), state, {}, later=lambda: frozenset({key(weight)}))
    assert store.copying  # the weight's copy runs beside training
    assert store.settle() is True  # unchanged meanwhile
    store.wait()
    got = held(store, 1)["model"]
    assert torch.equal(got["w"], weight) and torch.equal(got["b"], buffer)
    # A change between the snapshot and the wait is seen, whatever the copy caught: the
    # snapshot is dropped (never committed), step 1's stays.
    store.take(2, facts(2), state, {}, later=lambda: frozenset({key(weight)}))
    with torch.no_grad():
        weight.add_(1)
    assert store.settle() is False
    store.wait()
    assert sorted(store.inventory()[0]) == [1]
    # Nothing named: everything is copied at once, committed without a settle.
    store.take(3, facts(3), state, {})
    assert not store.copying
    store.wait()
    assert torch.equal(held(store, 3)["model"]["w"], weight)
    store.remove_mine()
    store.close()
    assert not os.path.exists(store.own_dir())


def test_the_copy_thread_stages_the_header_and_the_step_only_renames_it(tmp_path,
                                                                          monkeypatch):
    """After a copy on the CPU the snapshot thread writes the set's small state and
    stages its header (``a.next``) while training goes on; before the optimizer step
    the training thread checks the sources and renames the staged header into place,
    writing nothing itself. A dropped snapshot leaves no staged header."""
    store = SnapshotStore(str(tmp_path / "shm"), rank=0, world_size=1)
    weight = torch.arange(1000.0)
    state = {"model": {"w": weight}, "trainer": {}}
    later = lambda: frozenset({key(weight)})  # noqa: E731
    assert store.take(1, facts(1), state, {}, later=later)
    where = store._pending[1]
    store._pending[-1].result()  # the snapshot thread is done with the set
    staged = open(where.path("next"), "rb").read()
    assert not os.path.exists(where.path("json"))  # not committed before the check
    main, writes = threading.current_thread(), []
    real_open = open

    def watched(path, mode="r", *args, **kwargs):
        if "w" in mode and threading.current_thread() is main:
            writes.append(path)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", watched)
    assert store.settle() is True
    monkeypatch.undo()
    assert writes == []  # the training thread only renamed
    assert open(where.path("json"), "rb").read() == staged
    assert not os.path.exists(where.path("next"))
    assert torch.equal(held(store, 1)["model"]["w"], weight)
    store.take(2, facts(2), state, {}, later=later)
    dropped = store._pending[1]
    with torch.no_grad():
        weight.add_(1)  # the optimizer step came early: the snapshot is dropped
    assert store.settle() is False
    store.wait()
    assert not os.path.exists(dropped.path("next")) and not os.path.exists(
        dropped.path("json"))
    assert sorted(store.inventory()[0]) == [1]
    store.remove_mine()
    store.close()


def test_each_set_is_mapped_once_and_holds_the_current_values(tmp_path):
    """From the third snapshot on nothing is allocated or mapped (each set's pages are
    reused); each snapshot holds its own step's values, and a tensor given a new storage
    is copied from the new one."""
    store = SnapshotStore(str(tmp_path / "shm"), rank=0, world_size=1)
    weight, mapped = torch.arange(1000.0), []
    for step in range(1, 6):  # the same storage, changed in place between snapshots
        with torch.no_grad():
            weight.mul_(2)
        store.take(step, facts(step), {"model": {"w": weight}, "trainer": {}}, {},
                   later=lambda: frozenset({key(weight)}))
        assert store.settle()
        store.wait()
        assert torch.equal(held(store, step)["model"]["w"], weight)
        mapped.append(sorted(b.data.data_ptr() for b in store._buffers.values()))
    assert mapped[2] == mapped[3] == mapped[4] and len(mapped[4]) == 2
    replaced = torch.full((1000,), -1.0)  # a new storage of the same size
    store.take(6, facts(6), {"model": {"w": replaced}, "trainer": {}}, {},
               later=lambda: frozenset({key(replaced)}))
    assert store.settle()
    store.wait()
    assert torch.equal(held(store, 6)["model"]["w"], replaced)
    store.close()


def test_a_snapshot_keeps_the_shape_of_the_state_and_its_plain_values(tmp_path):
    """What comes back is the state as given: containers of their own types, scalars and
    sequences of scalars as they were, each tensor's values, tied tensors still tied."""
    store = SnapshotStore(str(tmp_path / "shm"), rank=0, world_size=1)
    tied = torch.arange(6.0)
    state = {"python": random.getstate(), "ints": [1, 2, 3], "none": None,
             "mixed": (1.5, torch.arange(3.0), [torch.ones(2), "x"]),
             "ordered": collections.OrderedDict(a=torch.zeros(4), b=7),
             "tied": [tied, tied[2:]], "set": {1, 2, 3}}
    store.take(1, facts(1), {"model": {}, "trainer": state}, {})
    store.wait()
    back = held(store, 1)["trainer"]
    assert back["python"] == state["python"] and type(back["python"]) is tuple
    assert back["ints"] == [1, 2, 3] and back["none"] is None and back["set"] == {1, 2, 3}
    assert type(back["mixed"]) is tuple and back["mixed"][0] == 1.5
    assert torch.equal(back["mixed"][1], torch.arange(3.0))
    assert torch.equal(back["mixed"][2][0], torch.ones(2)) and back["mixed"][2][1] == "x"
    assert type(back["ordered"]) is collections.OrderedDict and back["ordered"]["b"] == 7
    assert torch.equal(back["ordered"]["a"], torch.zeros(4))
    assert torch.equal(back["tied"][1], tied[2:])
    assert back["tied"][0].untyped_storage().data_ptr() == \
        back["tied"][1].untyped_storage().data_ptr()
    store.close()


def test_a_snapshot_holds_its_steps_values_when_they_change_before_the_commit(tmp_path,
                                                                            monkeypatch):
    """The small state is serialised when the snapshot is taken: changes the next step
    makes to the recipe's state while the copy is held back are not in it."""
    store = SnapshotStore(str(tmp_path / "shm"), rank=0, world_size=1)
    copy_all, go = snapshot_sets._copy_all, threading.Event()
    monkeypatch.setattr(snapshot_sets, "_copy_all", lambda pairs: (go.wait(10), copy_all(pairs)))
    weight = torch.arange(8.0)
    for step, odd in ((1, None), (2, {1, 2, 3})):
        go.clear()
        user = {"counts": [1, 2], "seen": {"a": 1}, **({"odd": odd} if odd is not None else {})}
        store.take(step, facts(step), {"model": {"w": weight}, "trainer": {"user": user}},
                   {"torch": torch.get_rng_state()}, later=lambda: frozenset({key(weight)}))
        user["counts"].append(3)  # the next step changes the recipe's state in place
        user["seen"]["a"] = 2
        if odd is not None:
            odd.add(99)
        go.set()
        assert store.settle() is True
        store.wait()
        got = held(store, step)["trainer"]["user"]
        assert got["counts"] == [1, 2] and got["seen"] == {"a": 1}
        if odd is not None:
            assert got["odd"] == {1, 2, 3}
    store.remove_mine()
    store.close()


class WaitForForward(Callback):
    """Holds the thread's copy of the parameters until the next step's forward has run
    (the test's 10 s are never reached when the forward does run meanwhile)."""

    def __init__(self, monkeypatch):
        self.forward_ran = threading.Event()
        self.overlapped: list[bool] = []
        copy_all = snapshot_sets._copy_all

        def held(pairs):
            self.overlapped.append(self.forward_ran.wait(10))
            self.forward_ran.clear()
            copy_all(pairs)

        monkeypatch.setattr(snapshot_sets, "_copy_all", held)


class MarksForward(LinearRecipe):
    def __init__(self, data, marker=None, **kw):
        super().__init__(data, **kw)
        self.marker = marker

    def train_step(self, global_step, batch, device):
        if self.marker is not None:
            self.marker.forward_ran.set()
        return super().train_step(global_step, batch, device)


def checkpoint_args(out, shm, **kw):
    return make_args(out, epochs=2, train_batch_size=10, micro_batch_size=5,
                     checkpoint={"at_epoch_end": False,
                                 "memory": {"every_n_steps": 1, "dir": str(shm)}}, **kw)


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_next_forward_runs_while_the_parameters_are_copied(tmp_path, monkeypatch, capfd):
    plain = MarksForward(IdData(40, 0), momentum=0.9)
    Trainer(plain, make_args(tmp_path / "ref", epochs=2, train_batch_size=10,
                             micro_batch_size=5)).train()
    want = weights(plain)

    waiter = WaitForForward(monkeypatch)
    model = MarksForward(IdData(40, 0), marker=waiter, momentum=0.9)
    shm = tmp_path / "shm"
    with pytest.raises(Crash):
        Trainer(model, checkpoint_args(tmp_path / "run", shm),
                callbacks=[waiter, CrashAt(6)]).train()
    # Each snapshot's copy went on while the next step's forward ran (the wait in
    # on_step_end settles the last one, after its step's own forward).
    assert waiter.overlapped[:-1] and all(waiter.overlapped[:-1])
    monkeypatch.undo()
    resumed = MarksForward(IdData(40, 0), momentum=0.9)
    Trainer(resumed, checkpoint_args(tmp_path / "run", shm)).train()
    assert "resuming from memory, step 5" in capfd.readouterr().err
    for name, value in want.items():
        assert torch.equal(weights(resumed)[name], value), name


class MaxNormRecipe(LinearRecipe):
    """An embedding with ``max_norm``: its forward rescales rows of its weight in place."""

    def __init__(self, data, **kw):
        super().__init__(data, **kw)
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 4, max_norm=0.5)

    def forward(self, x):
        return self.linear(x)

    def train_step(self, global_step, batch, device):
        ids, x, y = batch
        hidden = x.to(device) + self.embed(ids.to(device))
        return nn.functional.mse_loss(self.linear(hidden).squeeze(-1), y.to(device))


def test_a_forward_that_changes_its_weights_in_place_drops_that_snapshot(tmp_path, capfd):
    plain = MaxNormRecipe(IdData(40, 0))
    Trainer(plain, make_args(tmp_path / "ref", epochs=2, train_batch_size=10,
                             micro_batch_size=5)).train()
    model = MaxNormRecipe(IdData(40, 0))
    with Trainer(model, checkpoint_args(tmp_path / "run", tmp_path / "shm")) as trainer:
        trainer.train()
        snapshots = [c for c in trainer.callbacks if hasattr(c, "overlap")][0]
        assert snapshots.overlap is False  # copied at once after the first one
    err = capfd.readouterr().err
    assert err.count("changed between step") == 1
    assert "nn.Embedding(max_norm=...)" in err and "that snapshot is dropped" in err
    # Observing never changes the run.
    for name, value in weights(plain).items():
        assert torch.equal(weights(model)[name], value), name


def test_a_run_resumed_after_a_dropped_snapshot_is_bit_identical(tmp_path, capfd):
    plain = MaxNormRecipe(IdData(40, 0))
    Trainer(plain, make_args(tmp_path / "ref", epochs=2, train_batch_size=10,
                             micro_batch_size=5)).train()

    shm = tmp_path / "shm"
    with pytest.raises(Crash):
        Trainer(MaxNormRecipe(IdData(40, 0)), checkpoint_args(tmp_path / "run", shm),
                callbacks=[Settle(), CrashAt(6)]).train()
    resumed = MaxNormRecipe(IdData(40, 0))
    Trainer(resumed, checkpoint_args(tmp_path / "run", shm)).train()
    assert "resuming from memory, step 5" in capfd.readouterr().err
    for name, value in weights(plain).items():
        assert torch.equal(weights(resumed)[name], value), name


def test_without_cuda_the_buffer_is_not_registered_and_the_copy_is_a_thread_s(tmp_path):
    """The CUDA path imports and falls back on a machine without a GPU: registering a
    buffer says no, and CPU tensors are copied by the snapshot thread."""
    from sailfin.compat.torch import register_host_memory

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the cuda-marked test covers registration")
    assert register_host_memory(torch.empty(1024)) is False
    store = SnapshotStore(str(tmp_path / "shm"), rank=0, world_size=1)
    weight = torch.arange(100.0)
    store.take(1, facts(1), {"model": {"w": weight}, "trainer": {}}, {},
               later=lambda: frozenset({key(weight)}))
    assert not store._streams and not any(b.registered for b in store._buffers.values())
    assert store.settle() is True
    store.wait()
    assert torch.equal(held(store, 1)["model"]["w"], weight)
    store.close()


@pytest.mark.cuda
def test_a_cuda_snapshot_goes_on_a_side_stream_into_registered_memory(tmp_path):
    """The copy of CUDA tensors runs on a side stream into the set's buffer, registered
    with CUDA as pinned; the optimizer step queued after the settle waits for it on the
    device, so the snapshot holds the values before that step."""
    store = SnapshotStore(str(tmp_path / "shm"), rank=0, world_size=1)
    weight = torch.randn(4_000_000, device="cuda")
    before = weight.cpu()
    store.take(1, facts(1), {"model": {"w": weight}, "trainer": {}},
               {"torch": torch.get_rng_state()}, later=lambda: frozenset({key(weight)}))
    [buffer] = store._buffers.values()
    assert buffer.registered and buffer.data.is_pinned()
    assert store._streams  # the side stream
    assert store.settle() is True
    with torch.no_grad():
        weight.mul_(2)  # the optimizer step: after the copy, on the device
    store.wait()
    assert torch.equal(held(store, 1)["model"]["w"], before)
    store.close()
    assert not buffer.registered
