"""Async saves: only the copy into reused CPU buffers is on the step's path; the checksum
(threaded next to the write) is the same CRC-32 as before, so old checkpoints still verify."""

import threading
import zlib

import pytest
import torch

from sailfin.checkpoint import DirectoryCheckpointer
from sailfin.checkpoint import serialize
from sailfin.checkpoint.checkpointer import Snapshot
from sailfin.checkpoint.serialize import FileEntry, StagingBuffers, load_object, save_object
from sailfin.checkpoint.storage import LocalStorage
from sailfin.config import CheckpointArguments
from sailfin.distributed import DistEnv


def test_staging_reuses_its_buffers_and_keeps_sharing():
    emb = torch.nn.Embedding(300, 8)
    head = torch.nn.Linear(8, 300, bias=False)
    head.weight = emb.weight  # tied
    state = {"model": torch.nn.ModuleDict({"emb": emb, "head": head}).state_dict(),
             "opt": [{"momentum": torch.ones(4, 4)}], "step": 3}
    staging = StagingBuffers()
    first = staging.copy(state)
    ptr = first["model"]["emb.weight"].untyped_storage().data_ptr()
    assert ptr == first["model"]["head.weight"].untyped_storage().data_ptr()
    assert ptr != emb.weight.untyped_storage().data_ptr()
    assert first["step"] == 3 and first["model"]._metadata == state["model"]._metadata
    assert torch.equal(first["model"]["emb.weight"], emb.weight)

    with torch.no_grad():
        emb.weight.add_(1.0)  # the next optimizer step, in place
        state["opt"][0]["momentum"].mul_(2)
    # the copy is the state as it was, not as it is now
    assert not torch.equal(first["model"]["emb.weight"], emb.weight)
    assert torch.equal(first["opt"][0]["momentum"], torch.ones(4, 4))

    second = staging.copy(state)  # the previous save is written: its buffers are reused
    assert second["model"]["emb.weight"].untyped_storage().data_ptr() == ptr
    assert torch.equal(second["model"]["emb.weight"], emb.weight)
    assert torch.equal(second["opt"][0]["momentum"], 2 * torch.ones(4, 4))
    staging.ready()


def test_staging_drops_buffers_of_storages_that_are_gone():
    staging = StagingBuffers()
    staging.copy({"a": torch.zeros(10), "b": torch.zeros(20)})
    out = staging.copy({"a": torch.ones(30)})  # new storages: new buffers, old ones dropped
    assert torch.equal(out["a"], torch.ones(30)) and len(staging._buffers) == 1
    staging.release()
    assert staging._buffers == {}


@pytest.mark.parametrize("threshold", [1 << 20, 64])  # big buffers only / nearly every write
def test_threaded_checksum_is_the_files_crc32(tmp_path, monkeypatch, threshold):
    monkeypatch.setattr(serialize, "THREADED_CHECKSUM_BYTES", threshold)
    obj = {"big": torch.randn(600, 1000), "small": torch.arange(5), "name": "x"}
    path = str(tmp_path / "obj.pt")
    entry = save_object(LocalStorage(), path, obj)
    data = open(path, "rb").read()
    assert entry == FileEntry(len(data), zlib.crc32(data))  # what older checkpoints record
    loaded = load_object(LocalStorage(), path, entry)
    assert torch.equal(loaded["big"], obj["big"]) and loaded["name"] == "x"


def test_a_checkpoint_checksummed_the_old_way_still_verifies(tmp_path):
    path = str(tmp_path / "old.pt")
    torch.save({"w": torch.randn(700, 700)}, path)  # written without the helper thread
    data = open(path, "rb").read()
    loaded = load_object(LocalStorage(), path, FileEntry(len(data), zlib.crc32(data)))
    assert loaded["w"].shape == (700, 700)


class GatedCheckpointer(DirectoryCheckpointer):
    """Every file write waits for ``gate``: whatever runs on the caller's thread would hang."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.gate = threading.Event()
        self.writers: list[str] = []

    def write_file(self, path, obj):
        self.writers.append(threading.current_thread().name)
        assert self.gate.wait(10), "a write ran on the step's path"
        return super().write_file(path, obj)


def test_async_save_leaves_only_the_copy_on_the_steps_path(tmp_path):
    ckpt = GatedCheckpointer(str(tmp_path), CheckpointArguments(async_save=True), DistEnv())
    weights = torch.randn(100, 100)
    before = weights.clone()
    facts = {"step": 4, "epoch": 0, "step_in_epoch": 4, "samples_seen": 40, "world_size": 1}
    snapshot = Snapshot(step=4, facts=facts, shared={"model": {"w": weights}},
                        rank_state={"torch": torch.get_rng_state()})
    ckpt.save(snapshot)  # returns at once although no file may be written yet
    weights.add_(1.0)    # the next step changes the tensors: the save keeps the old values
    assert ckpt.latest() is None
    ckpt.gate.set()
    ckpt.close()
    assert ckpt.writers and all(n.startswith("sailfin-checkpoint") for n in ckpt.writers)
    loaded = ckpt.load(ckpt.latest())
    assert torch.equal(loaded.shared["model"]["w"], before)
    assert torch.equal(loaded.rank_state["torch"], snapshot.rank_state["torch"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_staging_cuda_tensors_go_to_pinned_memory_without_blocking():
    state = {"w": torch.randn(256, 256, device="cuda"), "b": torch.zeros(3, device="cuda")}
    before = state["w"].cpu()
    staging = StagingBuffers()
    copy = staging.copy(state)
    state["w"].add_(1.0)  # queued behind the copy on the same stream
    staging.ready()
    assert copy["w"].device.type == "cpu" and copy["w"].is_pinned()
    assert torch.equal(copy["w"], before)
    again = staging.copy(state)  # the same pinned buffer, refilled
    staging.ready()
    assert again["w"].untyped_storage().data_ptr() == copy["w"].untyped_storage().data_ptr()
    assert torch.equal(again["w"], state["w"].cpu())


def test_large_cpu_copies_are_split_over_threads_and_exact():
    """A state of many 4 MiB chunks is copied by several threads, byte for byte, views
    sharing one storage still share one buffer, and release() ends the threads."""
    import threading

    from sailfin.checkpoint.serialize import StagingBuffers

    big = torch.randn(5_000_000)  # 20 MB: five chunks
    state = {"w": big, "view": big[10:20], "small": torch.arange(7)}
    staging = StagingBuffers()
    copied = staging.copy(state)
    assert torch.equal(copied["w"], big) and torch.equal(copied["small"], state["small"])
    assert copied["view"].untyped_storage().data_ptr() == copied["w"].untyped_storage().data_ptr()
    assert copied["w"].data_ptr() != big.data_ptr()
    big.add_(1.0)  # the training goes on: the copy keeps the saved values
    assert not torch.equal(copied["w"], big)
    again = staging.copy(state)  # reuses the buffers, now with the new values
    assert torch.equal(again["w"], big)
    staging.release()
    assert not [t for t in threading.enumerate() if t.name.startswith("sailfin-stage")]


def test_async_shards_are_staged_into_copies_kept_from_save_to_save(tmp_path):
    """The model's async saves (DCP) stage into the same CPU buffers every time: no fresh
    allocation on the step's path; the copy is the state at the save, not after it."""
    ckpt = DirectoryCheckpointer(str(tmp_path), CheckpointArguments(async_save=True), DistEnv())
    weight = torch.ones(256, 256)
    staged = []

    def save(step):
        facts = {"step": step, "epoch": 0, "step_in_epoch": step, "samples_seen": step,
                 "world_size": 1}
        ckpt.save(Snapshot(step, facts, {"trainer": {"step": step}}, {"rng": torch.arange(2)},
                           sharded={"module": {"w": weight}}))

    save(1)
    stager = ckpt.shards._stager
    real_stage = stager.stage

    def spy(state, **kw):
        out = real_stage(state, **kw)
        staged.append(out["module"]["w"].untyped_storage().data_ptr())
        return out

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
