"""A memory snapshot copies the parameters and the optimizer's state while the next
forward and backward run; the optimizer step waits for that copy, and a snapshot whose
sources changed meanwhile (a forward that renormalises its weights in place) is dropped,
never written, and the rest of the run copies at once."""

import os
import threading

import pytest
import torch
from torch import nn

from sailfin import Callback, Trainer
from sailfin.checkpoint import memory_staging
from sailfin.checkpoint.memory_staging import SharedStaging
from tests.checkpoint.helpers import Crash, CrashAt
from tests.checkpoint.test_memory import Settle
from tests.recipes import IdData, LinearRecipe, args as make_args


def key(tensor):
    return (tensor.untyped_storage().data_ptr(), str(tensor.device))


def test_staging_copies_the_named_storages_in_a_thread_and_sees_a_change(tmp_path):
    staging = SharedStaging(str(tmp_path / "staging"))
    weight, buffer = torch.arange(1000.0), torch.zeros(3)
    staged, copying = staging.stage({"w": weight, "b": buffer}, frozenset({key(weight)}))
    assert copying is not None
    assert copying.finish()  # unchanged meanwhile
    for name, tensor in (("w", weight), ("b", buffer)):
        slot = staged[name]
        held = torch.from_file(str(tmp_path / "staging" / slot.name), shared=False,
                               size=tensor.numel(), dtype=tensor.dtype)
        assert torch.equal(held, tensor)
    # A change between the snapshot and the wait is seen, whatever the copy caught.
    staged, copying = staging.stage({"w": weight, "b": buffer}, frozenset({key(weight)}))
    with torch.no_grad():
        weight.add_(1)
    assert copying.finish() is False
    # Nothing named: everything is copied at once, no thread.
    assert staging.stage({"w": weight}, frozenset())[1] is None
    staging.release()
    assert not os.path.exists(tmp_path / "staging")


def test_staging_copies_the_current_values_and_a_replaced_storage(tmp_path):
    """The thread's byte views are made once per storage: later snapshots copy that
    storage's current values, and a tensor given a new storage is copied from the new one."""
    staging = SharedStaging(str(tmp_path / "staging"))

    def held(staged, tensor):
        return torch.from_file(str(tmp_path / "staging" / staged["w"].name), shared=False,
                               size=tensor.numel(), dtype=tensor.dtype)

    weight = torch.arange(1000.0)
    for change in range(3):  # the same storage, changed in place between snapshots
        with torch.no_grad():
            weight.mul_(2)
        staged, copying = staging.stage({"w": weight}, frozenset({key(weight)}))
        assert copying.finish() and torch.equal(held(staged, weight), weight)
    replaced = torch.full((1000,), -1.0)  # a new storage of the same size
    staged, copying = staging.stage({"w": replaced}, frozenset({key(replaced)}))
    assert copying.finish() and torch.equal(held(staged, replaced), replaced)
    staging.release()


def test_the_writer_keeps_staging_files_mapped_and_checksums_on_its_own_thread(tmp_path,
                                                                               monkeypatch):
    """From one snapshot to the next the writer reuses its mappings of the staging files
    (mapping anew faults every page in again), drops those of files no longer named, and
    computes the checksums on its own thread (no second core taken from training)."""
    from sailfin.checkpoint import memory_dirs, memory_writer, serialize

    staging = SharedStaging(str(tmp_path / "staging"))
    helpers: list = []
    write = serialize._ChecksumWriter.write

    def recorded(self, data):
        helpers.append(self.helper)
        return write(self, data)

    monkeypatch.setattr(serialize._ChecksumWriter, "write", recorded)
    mapped: dict = {}
    out = tmp_path / "snapshots"
    weight, other = torch.arange(4096.0), torch.ones(2048)
    seen = []
    for step, state in ((1, {"w": weight, "o": other}), (2, {"w": weight * 3}),
                        (3, {"w": weight * 3})):
        staged, _ = staging.stage({"model": state})
        facts = {"step": step, "epoch": 0, "step_in_epoch": step, "samples_seen": 0,
                 "world_size": 1}
        assert memory_writer.write_snapshot(str(out), f"step-{step}", staged, facts,
                                            staging.directory, mapped=mapped)
        seen.append(dict(mapped))
        assert memory_dirs.intact(str(out / f"step-{step}"))  # every file's CRC-32 matches
        loaded = torch.load(out / f"step-{step}" / "model.pt")
        assert loaded.keys() == state.keys()
        assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert len(seen[0]) == 2 and len(seen[1]) == 1  # the file step 2 no longer names: unmapped
    name = staged["model"]["w"].name
    assert seen[2][name] is seen[1][name]  # the same mapping, not made again
    assert helpers and all(h is None for h in helpers)  # no checksum thread beside the write
    staging.release()


def test_staging_keeps_the_shape_of_the_state_and_its_plain_values(tmp_path):
    """What the writer rebuilds is the state as given: containers of their own types,
    scalars and sequences of scalars as they were, each tensor's values."""
    import collections
    import random

    staging = SharedStaging(str(tmp_path / "staging"))
    state = {"python": random.getstate(), "ints": [1, 2, 3], "none": None,
             "mixed": (1.5, torch.arange(3.0), [torch.ones(2), "x"]),
             "ordered": collections.OrderedDict(a=torch.zeros(4), b=7)}
    staged, copying = staging.stage(state)
    assert copying is None  # nothing named for later: copied at once
    back = memory_staging.rebuild(staged, staging.directory, {})
    assert back["python"] == state["python"] and type(back["python"]) is tuple
    assert back["ints"] == [1, 2, 3] and back["none"] is None
    assert type(back["mixed"]) is tuple and back["mixed"][0] == 1.5
    assert torch.equal(back["mixed"][1], torch.arange(3.0))
    assert torch.equal(back["mixed"][2][0], torch.ones(2)) and back["mixed"][2][1] == "x"
    assert type(back["ordered"]) is collections.OrderedDict and back["ordered"]["b"] == 7
    assert torch.equal(back["ordered"]["a"], torch.zeros(4))
    staging.release()


def test_a_snapshot_holds_its_steps_values_when_they_change_before_the_write(tmp_path,
                                                                           monkeypatch):
    """The staged state's containers are its own and its scalars immutable, so it is
    written as it is (no pickled copy on the step's path); a value of another type (a
    set a recipe keeps in its state) is frozen when the snapshot is taken. Both are
    checked against changes made while the write waits for the thread's copy."""
    from sailfin.checkpoint.memory import MemoryStore

    store = MemoryStore(str(tmp_path / "shm"), rank=0, world_size=1)
    store.start_writer(wait=True)
    copy_all, go = memory_staging._copy_all, threading.Event()
    monkeypatch.setattr(memory_staging, "_copy_all",
                        lambda pairs: (go.wait(10), copy_all(pairs)))
    weight = torch.arange(8.0)
    for step, odd in ((1, None), (2, {1, 2, 3})):
        go.clear()
        user = {"counts": [1, 2], "seen": {"a": 1}, **({"odd": odd} if odd is not None else {})}
        facts = {"step": step, "epoch": 0, "step_in_epoch": step, "samples_seen": 0,
                 "world_size": 1}
        assert store.ready(step)
        store.stage(step, facts, {"model": {"w": weight}, "trainer": {"user": user}},
                    {"torch": torch.get_rng_state()}, later=frozenset({key(weight)}))
        assert store._staging.kept is (odd is not None)
        user["counts"].append(3)  # the next step changes the recipe's state in place
        user["seen"]["a"] = 2
        if odd is not None:
            odd.add(99)
        go.set()
        assert store.settle() is True
        store.wait()
        _, shared, _ = store.load(store.inventory()[0][step])
        held = shared["trainer"]["user"]
        assert held["counts"] == [1, 2] and held["seen"] == {"a": 1}
        if odd is not None:
            assert held["odd"] == {1, 2, 3}
    store.remove_mine()
    store.close()


class WaitForForward(Callback):
    """Holds the thread's copy of the parameters until the next step's forward has run
    (the test's 10 s are never reached when the forward does run meanwhile)."""

    def __init__(self, monkeypatch):
        self.forward_ran = threading.Event()
        self.overlapped: list[bool] = []
        copy_all = memory_staging._copy_all

        def held(pairs):
            self.overlapped.append(self.forward_ran.wait(10))
            self.forward_ran.clear()
            copy_all(pairs)

        monkeypatch.setattr(memory_staging, "_copy_all", held)

    def on_step_end(self, trainer):
        trainer.checkpointer.store.wait()  # each step's snapshot is taken, none skipped


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
