"""Memory snapshots in one process: the files, resume from them, damaged ones ignored,
the space check, leftovers of dead runs, ``sailfin clean``, nothing left at a normal end."""

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from sailfin import Callback, Trainer
from sailfin.checkpoint import CheckpointError, memory_dirs
from sailfin.checkpoint.memory import MemoryStore
from sailfin.cli import main
from tests.checkpoint.helpers import Crash, CrashAt
from tests.recipes import IdData, LinearRecipe, args as make_args


class Settle(Callback):
    """Waits at each step's end until its snapshot is written (a step waits only for the
    previous one's): for tests that look at the files, or crash during the next forward."""

    def on_step_end(self, trainer):
        trainer.checkpointer.store.wait()


def trainer_args(tmp_path, shm, **kw):
    memory = {"every_n_steps": 1, "dir": str(shm), **kw.pop("memory", {})}
    return make_args(tmp_path, epochs=3, train_batch_size=10, micro_batch_size=5,
                     checkpoint={"at_epoch_end": False, "memory": memory}, **kw)


def recipe():
    return LinearRecipe(IdData(47, 0), momentum=0.9, dropout=0.2)


def reference(tmp_path):
    model = recipe()
    Trainer(model, make_args(tmp_path / "ref", epochs=3, train_batch_size=10,
                             micro_batch_size=5)).train()
    return model


def crash(tmp_path, shm, step):
    with pytest.raises(Crash):
        Trainer(recipe(), trainer_args(tmp_path, shm), callbacks=[CrashAt(step)]).train()


def test_store_writes_checksummed_files_and_keeps_at_most_two(tmp_path):
    store = MemoryStore(str(tmp_path / "shm"), rank=0, world_size=1)
    weights = {"w": torch.arange(6.0)}
    for step in (1, 2, 3):
        store.save(step, {"step": step, "epoch": 0, "step_in_epoch": step, "samples_seen": 0,
                          "world_size": 1}, {"model": {"w": weights["w"] * step}, "trainer": {}},
                   {"torch": torch.get_rng_state()})
    store.wait()  # each save waited for the previous one's write: none was skipped
    held = store.inventory()[0]
    assert sorted(held) == [2, 3]  # the newest complete one and the one before it
    manifest, shared, rank_state = store.load(held[3])
    assert manifest["step"] == 3 and set(manifest["files"]) == {
        "model.pt", "trainer.pt", "rng-rank00000.pt"}
    assert torch.equal(shared["model"]["w"], torch.arange(6.0) * 3)
    store.remove_mine()
    store.close()
    assert not os.path.exists(store.own_dir())


def test_resume_from_memory_is_bit_identical(tmp_path, capfd):
    """Crashed just after step 7 (before its snapshot): step 6's snapshot is complete, as
    the steps take no time and step 7 waited for its write."""
    ref = reference(tmp_path)
    shm = tmp_path / "shm"
    crash(tmp_path / "run", shm, 7)
    assert sorted(os.listdir(shm / "rank00000")) == ["step-00000005", "step-00000006"]
    model = recipe()
    Trainer(model, trainer_args(tmp_path / "run", shm)).train()
    assert "resuming from memory, step 6" in capfd.readouterr().err
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert not shm.exists()  # removed at the normal end


def test_a_write_slower_than_the_steps_is_waited_for_and_a_crash_loses_one_step(
        tmp_path, capfd, monkeypatch):
    """Every write takes 0.2 s, a step almost nothing: each step waits for the previous
    snapshot's write before it is logged (skipping snapshots would lose more), so a crash
    just after step 7 resumes from step 6, and the run's end says what it waited."""
    write = MemoryStore._write

    def slow(self, *args, **kwargs):
        time.sleep(0.2)
        return write(self, *args, **kwargs)

    monkeypatch.setattr(MemoryStore, "_write", slow)
    ref = reference(tmp_path)
    shm = tmp_path / "shm"
    crash(tmp_path / "run", shm, 7)
    model = recipe()
    Trainer(model, trainer_args(tmp_path / "run", shm)).train()
    err = capfd.readouterr().err
    assert "resuming from memory, step 6" in err
    waited = re.search(r"memory snapshots: (\d+) of (\d+) waited ([\d.]+) s in all", err)
    assert waited and int(waited[1]) >= 5 and float(waited[3]) >= 0.1 * int(waited[1]), err
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("damage", ["checksum", "half-written"])
def test_a_damaged_or_half_written_snapshot_is_ignored(tmp_path, capfd, damage):
    ref = reference(tmp_path)
    shm = tmp_path / "shm"
    crash(tmp_path / "run", shm, 7)
    newest = shm / "rank00000" / "step-00000006"
    if damage == "checksum":
        data = bytearray((newest / "model.pt").read_bytes())
        data[-30] ^= 0xFF
        (newest / "model.pt").write_bytes(bytes(data))
    else:  # killed while writing: the manifest is written last, the rename comes after
        (newest / "manifest.json").unlink()
        newest.rename(newest.parent / ".tmp-step-00000006")
    model = recipe()
    Trainer(model, trainer_args(tmp_path / "run", shm)).train()
    assert "resuming from memory, step 5" in capfd.readouterr().err
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_too_little_shared_memory_stops_before_the_first_step(tmp_path, monkeypatch):
    monkeypatch.setattr(memory_dirs, "free_bytes", lambda path: 1000)
    model = recipe()
    with pytest.raises(CheckpointError) as err:
        Trainer(model, trainer_args(tmp_path, tmp_path / "shm")).train()
    text = str(err.value)
    assert "trainer.checkpoint.memory" in text and "0.0 MiB free" in text
    assert "trainer.checkpoint.memory.dir" in text and "every_n_steps: null" in text
    assert model.step_ids == []  # not one step was trained
    assert "\n" not in text


def test_a_dead_runs_leftovers_are_removed_and_clean_removes_a_runs(tmp_path, capfd):
    parent = tmp_path / "parent"
    dead = parent / "sailfin-0123456789ab-node0"
    (dead / "rank00000" / "step-00000003").mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (dead / "owner-rank00000.json").write_text(json.dumps(
        {"host": os.uname().nodename, "pid": gone.pid, "ppid": gone.pid}))
    alive = parent / "sailfin-ba9876543210-node0"
    alive.mkdir()
    (alive / "owner-rank00000.json").write_text(json.dumps(
        {"host": os.uname().nodename, "pid": os.getpid(), "ppid": os.getppid()}))
    shm = parent / "sailfin-mine-node0"
    crash(tmp_path / "run", shm, 2)
    assert not dead.exists() and alive.exists() and shm.exists()
    assert f"removed the memory snapshots of a run that is gone: {dead}" in capfd.readouterr().err
    assert main(["clean", str(tmp_path / "run")]) == 0
    assert not shm.exists() and alive.exists()


def test_nothing_is_left_in_dev_shm_after_a_normal_end(tmp_path):
    root = memory_dirs.snapshot_root(None, str(tmp_path), 0)
    assert root.startswith("/dev/shm/sailfin-")
    seen = []

    class Look(Callback):
        def on_step_end(self, trainer):
            mine = os.path.join(root, "rank00000")
            seen.append(sorted(os.listdir(mine)) if os.path.exists(mine) else [])

    args = make_args(tmp_path, epochs=1, train_batch_size=10, micro_batch_size=5,
                     checkpoint={"memory": {"every_n_steps": 1}})
    try:
        Trainer(recipe(), args, callbacks=[Settle(), Look()]).train()
    finally:
        survived = os.path.exists(root)
        memory_dirs.clean(str(tmp_path))  # a failed run leaves no RAM behind either
    assert not survived
    # Before step 3's snapshot: step 1's, and step 2's written or being written.
    assert "step-00000001" in seen[2]
    assert set(seen[2]) <= {"step-00000001", "step-00000002", ".tmp-step-00000002"}
    assert not os.path.exists(root)
    prefix = f"sailfin-{memory_dirs.run_id(str(tmp_path))}"
    assert not [e for e in os.listdir("/dev/shm") if e.startswith(prefix)]


@pytest.mark.parametrize("async_save", [False, True])
def test_persisted_every_n_steps_through_the_async_path(tmp_path, async_save):
    ref = reference(tmp_path)
    shm = tmp_path / "shm"
    run = tmp_path / "run"
    args = trainer_args(run, shm, memory={"persist_every_n_steps": 4})
    args.checkpoint.async_save = async_save
    trainer = Trainer(recipe(), args, callbacks=[Settle(), CrashAt(7)])
    with pytest.raises(Crash):
        trainer.train()
    assert trainer.checkpointer.inner.args.async_save  # persisting saves are async
    assert (run / "checkpoints" / "step-00000004" / "manifest.json").exists()
    assert not (run / "checkpoints" / "step-00000006").exists()
    model = recipe()
    Trainer(model, trainer_args(run, shm, memory={"persist_every_n_steps": 4})).train()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert (run / "checkpoints" / "step-00000012" / "manifest.json").exists()


def test_a_snapshot_of_another_world_size_is_not_offered(tmp_path):
    store = MemoryStore(str(tmp_path / "shm"), rank=0, world_size=1)
    facts = {"step": 4, "epoch": 0, "step_in_epoch": 4, "samples_seen": 0, "world_size": 2}
    store.save(4, facts, {"model": {"w": torch.ones(2)}, "trainer": {}}, {})
    store.wait()
    assert store.inventory() == {}  # a resized job resumes from disk
    store.close()


def test_a_real_tiny_tmpfs_stops_the_run_before_its_first_step(tmp_path):
    """The memory check against a real 64 KiB tmpfs (a private mount namespace)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    probe = subprocess.run(["unshare", "-r", "-m", "sh", "-c",
                            f"mount -t tmpfs -o size=64k tmpfs {mount}"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {probe.stderr!r}")
    from tests.checkpoint.test_kill import write_config
    config = write_config(tmp_path, "run", 0, checkpoint=(
        f"memory: {{every_n_steps: 1, dir: '{mount}/shm'}}"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        ["unshare", "-r", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {mount} && "
         f"exec {sys.executable} -m sailfin train {config}"],
        capture_output=True, text=True, cwd=root, timeout=300,
        env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 2, done.stderr
    [line] = [x for x in done.stderr.splitlines() if "trainer.checkpoint.memory" in x]
    assert "free; enlarge /dev/shm" in line and f"{mount}/shm has 0.1 MiB free" in line
    events = (tmp_path / "run" / "metrics.jsonl")
    assert not events.exists() or '"train"' not in events.read_text()  # no step trained


def test_the_writer_leaves_file_checksums_to_the_manifest_and_damage_is_still_found(tmp_path):
    """The writer process skips torch.save's CRC-32 of each zip record (half of a
    snapshot's write time; torch.load never checks it): the manifest's CRC-32 of each
    whole file is what finds damage."""
    import zipfile

    from sailfin.checkpoint import CheckpointCorrupt

    store = MemoryStore(str(tmp_path / "shm"), rank=0, world_size=1)
    facts = {"step": 1, "epoch": 0, "step_in_epoch": 1, "samples_seen": 0, "world_size": 1}
    weight = torch.randn(300_000)
    store.save(1, facts, {"model": {"w": weight}, "trainer": {}},
               {"torch": torch.get_rng_state()})
    store.wait()
    path = store.inventory()[0][1]
    model = os.path.join(path, "model.pt")
    with zipfile.ZipFile(model) as archive:
        assert {i.CRC for i in archive.infolist()} == {0}
    assert torch.equal(store.load(path)[1]["model"]["w"], weight)  # read back whole
    raw = bytearray(open(model, "rb").read())
    raw[len(raw) // 2] ^= 0x01  # a bit of the tensor's data
    open(model, "wb").write(bytes(raw))
    with pytest.raises(CheckpointCorrupt, match="CRC-32"):
        store.load(path)
    store.close()


def test_the_writer_of_a_killed_worker_ends_without_a_traceback():
    """Its training process gone (the reply pipe closed), the snapshot writer ends quietly."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from sailfin.checkpoint.memory_writer import "
         "_serve; _serve(int(sys.argv[1]))", "1"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the worker died: nobody reads the replies
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0 and b"Traceback" not in err and b"BrokenPipe" not in err, err
