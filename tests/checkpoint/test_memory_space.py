"""The space check counts what a snapshot really holds (the optimizer's state as after
its first step) before step 1; a tmpfs that fills mid-run stops the snapshots with one
warning and the run trains on, bit-identical, its disk checkpoints written."""

import os
import subprocess

import pytest
import torch

from sailfin import Callback, Trainer
from sailfin.checkpoint import CheckpointError
from sailfin.trainer.checkpointing.memory_snapshots import (MemorySnapshots, snapshots_of,
                                                         state_bytes, stepped_state_bytes)
from tests.checkpoint.test_memory import steps_held
from tests.checkpoint.memory_observer import AdamWRecipe
from tests.recipes import IdData, args

HIDDEN = 1 << 16  # 393,217 parameters: 1.5 MiB, and AdamW's state 3 MiB more


@pytest.fixture
def tmpfs(tmp_path):
    """Mount a real tmpfs of a given size (root only); unmounted at the end."""
    mounts = []

    def mount(size: str):
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        where = tmp_path / f"tmpfs{len(mounts)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                               str(where)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        subprocess.run(["umount", str(where)], check=True)


def run_args(out, shm, **kw):
    checkpoint = {"at_epoch_end": False, "every_n_steps": 3,
                  "memory": {"every_n_steps": 1, "dir": str(shm)}, **kw.pop("checkpoint", {})}
    return args(out, epochs=2, train_batch_size=10, micro_batch_size=5, progress="none",
                checkpoint=checkpoint, **kw)


def recipe():
    return AdamWRecipe(IdData(47, 0), hidden=HIDDEN)


def test_an_optimizer_is_sized_from_its_parameters_without_stepping_it():
    model = recipe()
    opt = model.get_optimizers_schedulers(5, 2)[0][0]
    before = [p.detach().clone() for p in model.parameters()]
    params = sum(p.numel() * 4 for p in model.parameters())
    # AdamW: exp_avg and exp_avg_sq per parameter, and a 4-byte step per tensor.
    assert stepped_state_bytes(opt) == 2 * params + 4 * len(before)
    assert not opt.state  # the real optimizer did not step
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    # Once it has stepped, its real state is what is counted.
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert stepped_state_bytes(opt) == state_bytes(dict(opt.state)) == 2 * params + 16


def test_a_tmpfs_the_first_step_would_overflow_is_refused_before_step_1(tmp_path, tmpfs):
    # Two buffer sets of the weights alone (2 x 1.6 MiB with the files' overhead) fit in
    # 6 MiB; with AdamW's state (2 x 4.6 MiB) they do not.
    shm = tmpfs("6m")
    model = recipe()
    with pytest.raises(CheckpointError) as err:
        Trainer(model, run_args(tmp_path / "run", shm / "snapshots")).train()
    text = str(err.value)
    assert "\n" not in text
    assert "trainer.checkpoint.memory: snapshots need 9.1 MiB on node 0" in text
    assert f"{shm}/snapshots has 6.0 MiB free" in text
    assert "trainer.checkpoint.memory.dir" in text
    assert model.step_ids == []  # not one step trained


class FillAt(Callback):
    """Another process's files fill the tmpfs at ``step`` (before its snapshot), all but
    1 MiB; records what the snapshot directory holds at every step."""

    def __init__(self, mount, step):
        self.mount, self.step, self.held = mount, step, []

    def on_step_end(self, trainer):
        store = snapshots_of(trainer).store
        store.wait()
        if trainer.global_step == self.step:
            free = os.statvfs(self.mount)
            with open(self.mount / "other-job.bin", "wb") as fh:
                fh.write(b"\0" * (free.f_bavail * free.f_frsize - (1 << 20)))
        own = store.own_dir()  # (this step's snapshot comes after)
        held = steps_held(own)
        first = [n for n, step in held.items() if step == 1]
        self.held.append((trainer.global_step, sorted(os.listdir(own)) if os.path.isdir(own)
                          else [], held, sum(
            os.path.getsize(os.path.join(own, f"{first[0]}.{e}")) for e in ("bin", "pt", "json"))
            if first else 0))


def test_a_tmpfs_filling_mid_run_stops_snapshots_and_training_goes_on(tmp_path, tmpfs,
                                                                       capfd):
    ref = recipe()
    Trainer(ref, run_args(tmp_path / "ref", tmp_path / "ref-shm",
                          checkpoint={"memory": {}})).train()
    capfd.readouterr()
    mount = tmpfs("24m")
    fill = FillAt(mount, 2)
    model = recipe()
    trainer = Trainer(model, run_args(tmp_path / "run", mount / "snapshots"), callbacks=[fill])
    trainer.train()
    # What was counted before step 1 is what the snapshot of step 1 held.
    [snapshots] = [c for c in trainer.callbacks if isinstance(c, MemorySnapshots)]
    size = fill.held[1][3]
    assert 0.9 * snapshots.snapshot_bytes <= size <= snapshots.snapshot_bytes
    err = capfd.readouterr().err
    stopped = [line for line in err.splitlines() if "memory snapshots stopped" in line]
    assert len(stopped) == 1, err  # one warning
    assert f"{mount}/snapshots is full" in stopped[0]
    assert "training and disk checkpoints go on" in stopped[0]
    # Trained to the end, bit-identical to the run without snapshots.
    assert len(model.step_ids) == 10
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    # Disk checkpoints went on after the snapshots stopped.
    assert (tmp_path / "run" / "checkpoints" / "step-00000009" / "manifest.json").exists()
    # Step 2's snapshot did not fit: after the stop only step 1's set is left (committed,
    # resumable), nothing half-written, nothing new.
    assert [(names, held) for step, names, held, _ in fill.held if step > 3] == [
        (["a.bin", "a.json", "a.pt"], {"a": 1})] * 7
