"""Async saves: only the copy to CPU memory is on the step's path (the small state's copy
is its bytes, made at the save); checkpoints of earlier releases still verify."""

import threading
import zlib

import pytest
import torch

from sailfin.checkpoint import DirectoryCheckpointer
from sailfin.checkpoint.checkpointer import SaveRequest
from sailfin.checkpoint.dcp_io import split_sharded
from sailfin.checkpoint.serialize import FileEntry, load_object
from sailfin.checkpoint.storage import LocalStorage
from sailfin.config import CheckpointArguments
from sailfin.distributed import DistEnv
from tests.checkpoint.helpers import before_writing, saved_model


def test_a_callback_that_asks_goes_to_dcp_and_the_others_stay_in_trainer_pt():
    """EMA's averages (state_in_dcp) are staged and written by DCP with the model (reused
    buffers for an async save); another callback's state, tensors or not, stays in the
    trainer's small state as it is."""
    state = {"module": {"w": torch.ones(2)}, "optimizers": [{"state": {}}], "step": 7,
             "callbacks": {"ema": {"decay": 0.9, "shadow": {"w": torch.zeros(2)}},
                           "History": {"losses": torch.zeros(3)},
                           "EarlyStopping": {"best": 0.5}}}
    sharded = split_sharded(state, {"ema"})
    assert sorted(sharded) == ["callbacks/ema", "module", "optimizers"]
    assert state == {"step": 7, "callbacks": {"History": {"losses": state["callbacks"][
        "History"]["losses"]}, "EarlyStopping": {"best": 0.5}}}


def test_a_callback_whose_tensors_grow_resumes(tmp_path):
    """A callback's own tensors may change shape from step to step (a history): they stay
    in the trainer's small state (its bytes entry), so a resume gives them back whatever shape the fresh callback starts
    with."""
    from sailfin import Callback, Trainer
    from tests.recipes import IdData, LinearRecipe, args

    class History(Callback):
        def __init__(self):
            self.steps = torch.zeros(0)

        def on_step_end(self, trainer):
            self.steps = torch.cat([self.steps, torch.tensor([float(trainer.global_step)])])

        def state_dict(self):
            return {"steps": self.steps}

        def load_state_dict(self, state):
            self.steps = state["steps"].clone()

    saves = {"at_epoch_end": False, "every_n_steps": 3, "async_save": True}
    Trainer(LinearRecipe(IdData(100, 12)), args(tmp_path, epochs=2, max_steps=3,
                                                checkpoint=saves), callbacks=[History()]).train()
    history = History()
    Trainer(LinearRecipe(IdData(100, 12)), args(tmp_path, epochs=2, max_steps=5,
                                                checkpoint=saves), callbacks=[history]).train()
    assert history.steps.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_a_checkpoint_checksummed_the_old_way_still_verifies(tmp_path):
    path = str(tmp_path / "old.pt")
    torch.save({"w": torch.randn(700, 700)}, path)  # written without the helper thread
    data = open(path, "rb").read()
    loaded = load_object(LocalStorage(), path, FileEntry(len(data), zlib.crc32(data)))
    assert loaded["w"].shape == (700, 700)


class GatedCheckpointer(DirectoryCheckpointer):
    """Every shard write waits for ``gate``: whatever runs on the caller's thread would hang."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.gate = threading.Event()
        self.writers: list[str] = []

    def shard_writer(self, path):
        def gated():
            self.writers.append(threading.current_thread().name)
            assert self.gate.wait(10), "a write ran on the step's path"
        return before_writing(super().shard_writer(path), gated)


def test_async_save_leaves_only_the_copy_on_the_steps_path(tmp_path):
    ckpt = GatedCheckpointer(str(tmp_path), CheckpointArguments(async_save=True), DistEnv())
    weights = torch.randn(100, 100)
    before = weights.clone()
    counters = {"step": 4, "history": torch.arange(3.0)}
    facts = {"step": 4, "epoch": 0, "step_in_epoch": 4, "samples_seen": 40, "world_size": 1}
    snapshot = SaveRequest(step=4, facts=facts, shared={"trainer": counters},
                           rank_state={"torch": torch.get_rng_state()},
                           sharded={"module": {"w": weights}})
    ckpt.save(snapshot)  # returns at once although no file may be written yet
    weights.add_(1.0)    # the next step changes the tensors: the save keeps the old values
    counters["history"].add_(1.0)  # the small state too: its bytes were made at the save
    assert ckpt.latest() is None
    ckpt.gate.set()
    ckpt.close()
    assert ckpt.writers and all(n.startswith("sailfin-dcp-save") for n in ckpt.writers)
    loaded = ckpt.load(ckpt.latest())
    assert torch.equal(saved_model(tmp_path / ckpt.latest(), {"w": weights})["w"],
                       before)
    assert torch.equal(loaded.shared["trainer"]["history"], torch.arange(3.0))
    assert torch.equal(loaded.rank_state["torch"], snapshot.rank_state["torch"])


def test_async_shards_are_staged_into_copies_kept_from_save_to_save(tmp_path):
    """The model's async saves (DCP) stage into the same CPU buffers every time: no fresh
    allocation on the step's path; the copy is the state at the save, not after it."""
    ckpt = DirectoryCheckpointer(str(tmp_path), CheckpointArguments(async_save=True), DistEnv())
    weight = torch.ones(256, 256)
    staged = []

    def save(step):
        facts = {"step": step, "epoch": 0, "step_in_epoch": step, "samples_seen": step,
                 "world_size": 1}
        ckpt.save(SaveRequest(step, facts, {"trainer": {"step": step}}, {"rng": torch.arange(2)},
                           sharded={"module": {"w": weight}}))

    save(1)
    stager = ckpt.shards._stager
    real_stage = stager.stage

    def spy(state, later, step):
        out, fill = real_stage(state, later, step)
        staged.append(out["module"]["w"].untyped_storage().data_ptr())
        return out, fill

    stager.stage = spy
    weight.add_(1.0)
    save(2)
    weight.add_(1.0)  # after the save: not in it
    save(3)
    ckpt.close()
    assert len(staged) == 2 and staged[0] == staged[1] != weight.untyped_storage().data_ptr()
    import torch.distributed.checkpoint as dcp

    for step, value in ((2, 2.0), (3, 3.0)):
        state = {"module": {"w": torch.zeros(256, 256)}}
        dcp.load(state, checkpoint_id=str(tmp_path / f"step-{step:08d}" / "shards"),
                 no_dist=True)
        assert torch.equal(state["module"]["w"], torch.full((256, 256), value))
    assert ckpt.shards._stager is None  # closed with the checkpointer


def test_an_async_save_copies_the_optimizer_state_while_the_next_step_runs(tmp_path):
    """The optimizers' state (``later``) is copied by the writing thread, after the save
    returns; the parameters are copied before it returns. Either way the checkpoint holds
    the values at the save; a change to ``later`` before settle() is refused."""
    import torch.distributed.checkpoint as dcp

    from sailfin.checkpoint.errors import CheckpointError
    from sailfin.checkpoint.staging import storage_key

    ckpt = DirectoryCheckpointer(str(tmp_path), CheckpointArguments(async_save=True), DistEnv())
    weight, momentum = torch.ones(64, 64), torch.full((64, 64), 5.0)
    gate = threading.Event()

    def save(step):
        facts = {"step": step, "epoch": 0, "step_in_epoch": step, "samples_seen": step,
                 "world_size": 1}
        ckpt.save(SaveRequest(step, facts, {"trainer": {"step": step}}, {"rng": torch.arange(2)},
                           sharded={"module": {"w": weight}, "optimizers": {"m": momentum}},
                           later=frozenset({storage_key(momentum)})))

    save(1)
    assert ckpt.settle() is True and ckpt.settle() is False  # one copy, settled once
    ckpt.wait()
    ckpt.shards._thread.submit(gate.wait)  # the writing thread is busy: the copy waits
    save(2)
    weight.add_(1.0)  # the next forward may change parameters: copied already
    gate.set()
    assert ckpt.settle() is True
    momentum.mul_(2)  # the optimizer step, after settle()
    ckpt.wait()
    gate.clear()
    ckpt.shards._thread.submit(gate.wait)
    save(3)
    momentum.add_(1.0)  # an optimizer stepped before settle(): that save is not one step's
    gate.set()
    with pytest.raises(CheckpointError, match="step 3.*async_save: false"):
        ckpt.settle()
    with pytest.raises(CheckpointError, match="step 3.*async_save: false"):
        ckpt.wait()  # the writer refused it too: DCP fails the save on every rank
    ckpt.abort()
    ckpt.close()
    assert ckpt.latest() == "step-00000002"
    state = {"module": {"w": torch.zeros(64, 64)}, "optimizers": {"m": torch.zeros(64, 64)}}
    dcp.load(state, checkpoint_id=str(tmp_path / "step-00000002" / "shards"), no_dist=True)
    assert torch.equal(state["module"]["w"], torch.ones(64, 64))
    assert torch.equal(state["optimizers"]["m"], torch.full((64, 64), 5.0))


def test_async_saves_of_a_gpt_hold_each_steps_adamw_state(tmp_path):
    """A nanoGPT-style model with AdamW, async saves every 2 steps: each checkpoint holds
    the optimizer state of its step (the copy ran while the next step's forward and
    backward did), the time waited is counted, the same run with synchronous saves
    writes the same bytes, and both end with the weights of the run without saves."""
    from sailfin import Callback, Trainer
    from tests.distributed.zoo_models import GPT, Tokens
    from tests.recipes import args

    class Record(Callback):  # after the saver: the state the save was given
        def __init__(self):
            self.at = {}

        def on_step_end(self, trainer):
            if trainer.global_step % 2 == 0:
                opt = trainer.optimizers[0]
                self.at[trainer.global_step] = [
                    {k: v.clone() for k, v in opt.state[p].items()}
                    for p in trainer.module.parameters()]

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    torch.manual_seed(0)
    unobserved = Trainer(GPT(Tokens()), args(tmp_path / "off", epochs=1, max_steps=6,
                                             train_batch_size=8, micro_batch_size=8,
                                             checkpoint={"at_epoch_end": False}))
    unobserved.train()  # no saves at all: the runs below must end with its weights
    runs = {}
    for mode in (True, False):
        out = tmp_path / str(mode)
        record = Record()
        torch.manual_seed(0)
        trainer = Trainer(GPT(Tokens()), args(out, epochs=1, max_steps=6, train_batch_size=8,
                                              micro_batch_size=8, checkpoint={
                                                  "every_n_steps": 2, "at_epoch_end": False,
                                                  "keep_last": None, "async_save": mode}))
        trainer.callbacks.append(record)
        trainer.train()
        for a, b in zip(trainer.module.parameters(), unobserved.module.parameters()):
            assert torch.equal(a, b), mode
        saver = trainer.saver
        assert len(saver.stall_seconds) == 3 and min(saver.stall_seconds) > 0
        for step in (2, 4):
            shards = out / "checkpoints" / f"step-{step:08d}" / "shards"
            dcp_to_torch_save(str(shards), str(tmp_path / f"{mode}-{step}.pt"))
            saved = torch.load(tmp_path / f"{mode}-{step}.pt", weights_only=False)
            names = [n for n, _ in trainer.module.named_parameters()]
            for name, expected in zip(names, record.at[step]):
                for key, value in expected.items():
                    assert torch.equal(saved["optimizers"]["0"]["state"][name][key], value), (
                        mode, step, name, key)
            runs[(mode, step)] = saved
    for step in (2, 4):
        a, b = runs[(True, step)], runs[(False, step)]
        assert a["module"].keys() == b["module"].keys()
        assert all(torch.equal(a["module"][k], b["module"][k]) for k in a["module"])


def test_an_optimizer_stepped_outside_the_step_refuses_that_async_save(tmp_path):
    """A callback that changes the optimizer state between an async save and the next
    optimizer step: that save is refused before it is committed, the error says what to
    set, the earlier checkpoint stays; the advice (async_save: false) runs to the end."""
    from sailfin import Callback, Trainer
    from sailfin.checkpoint.errors import CheckpointError
    from tests.recipes import IdData, LinearRecipe, args

    class Meddle(Callback):
        def __init__(self):
            self.gate = threading.Event()

        def on_step_end(self, trainer):  # before the saver's: keep the writer thread busy
            writer = getattr(trainer.checkpointer.shards, "_thread", None)
            if trainer.global_step == 4 and writer is not None:
                writer.submit(self.gate.wait)  # so that step 4's copy comes after the change

        def on_step_begin(self, trainer):
            if trainer.global_step == 4:  # after the save of step 4, before step 5's update
                for state in trainer.optimizers[0].state.values():
                    state["momentum_buffer"].mul_(0.5)
                self.gate.set()

    def run(async_save):
        saves = {"at_epoch_end": False, "every_n_steps": 2, "async_save": async_save,
                 "keep_last": None}
        return Trainer(LinearRecipe(IdData(100, 12), momentum=0.9),
                       args(tmp_path / str(async_save), max_steps=6, checkpoint=saves),
                       callbacks=[Meddle()])

    with pytest.raises(CheckpointError, match="step 4 began.*async_save: false.*previous "
                                              "checkpoint step-00000002 is kept"):
        run(True).train()
    assert sorted(p.name for p in (tmp_path / "True" / "checkpoints").iterdir()) == [
        "latest", "step-00000002"]
    trainer = run(False)
    trainer.train()
    assert trainer.global_step == 6 and trainer.checkpointer.latest() == "step-00000006"


def test_a_failed_copy_of_the_optimizer_state_fails_that_save_and_keeps_the_last(tmp_path):
    """The writer thread's copy fails (memory, say): DCP's save fails on every rank rather
    than leave one rank out of its collectives, nothing is committed, the error says why."""
    from sailfin.checkpoint.errors import CheckpointError
    from sailfin.checkpoint.staging import storage_key

    ckpt = DirectoryCheckpointer(str(tmp_path), CheckpointArguments(async_save=True), DistEnv())
    momentum = torch.ones(8, 8)

    def save(step):
        facts = {"step": step, "epoch": 0, "step_in_epoch": step, "samples_seen": step,
                 "world_size": 1}
        ckpt.save(SaveRequest(step, facts, {"trainer": {"step": step}}, {"rng": torch.arange(2)},
                           sharded={"optimizers": {"m": momentum}},
                           later=frozenset({storage_key(momentum)})))

    save(1)
    ckpt.wait()

    def no_memory(state):
        raise MemoryError("cannot allocate 256 bytes")

    ckpt.shards._stager._later.stage = no_memory
    save(2)
    with pytest.raises(CheckpointError, match="step 2 to CPU memory failed: cannot allocate"):
        ckpt.settle()  # the trainer's one line (and the partial save removed) follow
    with pytest.raises(CheckpointError, match="copying the optimizers' state to CPU memory "
                                              "failed: cannot allocate"):
        ckpt.wait()
    ckpt.abort()
    ckpt.close()
    assert ckpt.latest() == "step-00000001"
