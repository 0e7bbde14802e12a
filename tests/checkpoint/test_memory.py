"""Memory snapshots in one process: the buffer sets, resume from them, damaged ones
ignored, the space check, leftovers of dead runs, ``sailfin clean``, nothing left at a
normal end."""

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from sailfin import Callback, Trainer
from sailfin.checkpoint import CheckpointCorrupt, CheckpointError, snapshot_dirs
from sailfin.checkpoint import snapshot_sets
from sailfin.checkpoint.snapshot_sets import Location, read_header
from sailfin.checkpoint.snapshots import SnapshotStore
from sailfin.cli import main
from sailfin.trainer.checkpointing.memory_snapshots import snapshots_of
from tests.checkpoint.helpers import Crash, CrashAt
from tests.recipes import IdData, LinearRecipe, args as make_args


class Settle(Callback):
    """Waits at each step's end until the previous snapshot is committed and agreed on:
    for tests that look at the files."""

    def on_step_end(self, trainer):
        snapshots_of(trainer).store.wait()


def steps_held(directory):
    """Set name -> the step its committed header names."""
    held = {}
    for name in ("a", "b"):
        try:
            held[name] = read_header(Location(str(directory), name))["step"]
        except CheckpointCorrupt:
            pass
    return held


def facts(step, world_size=1):
    return {"step": step, "epoch": 0, "step_in_epoch": step, "samples_seen": 0,
            "world_size": world_size}


def trainer_args(tmp_path, shm, **kw):
    memory = {"every_n_steps": 1, "dir": str(shm), **kw.pop("memory", {})}
    checkpoint = {"at_epoch_end": False, "memory": memory, **kw.pop("checkpoint", {})}
    return make_args(tmp_path, epochs=3, train_batch_size=10, micro_batch_size=5,
                     checkpoint=checkpoint, **kw)


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


def test_the_store_keeps_two_buffer_sets_and_no_copy_of_its_tensors_elsewhere(tmp_path):
    store = SnapshotStore(str(tmp_path / "shm"), rank=0, world_size=1)
    weight = torch.arange(300_000.0)
    for step in (1, 2, 3):
        assert store.take(step, facts(step), {"model": {"w": weight * step}, "trainer": {}},
                          {"torch": torch.get_rng_state()})
        store.wait()
    held = store.inventory()[0]
    assert sorted(held) == [2, 3]  # the newest committed one and the one before it
    assert sorted(os.listdir(store.own_dir())) == [
        "a.bin", "a.json", "a.pt", "b.bin", "b.json", "b.pt"]
    header, shared, rank_state = store.load(held[3])
    assert header["step"] == 3 and torch.equal(shared["model"]["w"], weight * 3)
    assert torch.equal(rank_state["torch"], torch.get_rng_state())
    # The tensors are in the .bin only: the .pt holds their places and the small state.
    assert os.path.getsize(held[3].path("pt")) < 16_000
    assert os.path.getsize(held[3].path("bin")) < 1.01 * weight.nbytes + 16_000
    store.remove_mine()
    store.close()
    assert not os.path.exists(store.own_dir())


def test_resume_from_memory_is_bit_identical(tmp_path, capfd):
    """Crashed just after step 7 (before its snapshot): step 6's snapshot was committed
    before step 7's optimizer step."""
    ref = reference(tmp_path)
    shm = tmp_path / "shm"
    crash(tmp_path / "run", shm, 7)
    assert sorted(steps_held(shm / "rank00000").values()) == [5, 6]
    model = recipe()
    Trainer(model, trainer_args(tmp_path / "run", shm)).train()
    assert "resuming from memory, step 6" in capfd.readouterr().err
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert not shm.exists()  # removed at the normal end


def test_a_copy_slower_than_the_steps_is_waited_for_and_a_crash_loses_one_step(
        tmp_path, capfd, monkeypatch):
    """Every copy beside training takes 0.2 s, a step almost nothing: each optimizer step
    waits for it (a snapshot is never skipped), so a crash just after step 7 resumes from
    step 6, and the run's end says what the steps waited."""
    copy_all = snapshot_sets._copy_all

    def slow(pairs):
        time.sleep(0.2)
        copy_all(pairs)

    monkeypatch.setattr(snapshot_sets, "_copy_all", slow)
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


def flip(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["tensors", "state", "header", "lost", "half-written"])
def test_a_damaged_lost_or_half_written_snapshot_is_fallen_back_from(tmp_path, capfd, damage):
    ref = reference(tmp_path)
    shm = tmp_path / "shm"
    crash(tmp_path / "run", shm, 7)
    own = shm / "rank00000"
    newest = next(n for n, step in steps_held(own).items() if step == 6)
    if damage == "tensors":  # a bit of the weights (copied beside training: sampled)
        flip(own / f"{newest}.bin", 5)
    elif damage == "state":
        flip(own / f"{newest}.pt", -30)
    elif damage == "header":
        text = (own / f"{newest}.json").read_text()
        (own / f"{newest}.json").write_text(text.replace('"epoch": 1', '"epoch": 2'))
    elif damage == "lost":
        (own / f"{newest}.bin").unlink()
    else:  # killed while copying into the set: its header was removed first
        (own / f"{newest}.json").unlink()
    model = recipe()
    Trainer(model, trainer_args(tmp_path / "run", shm)).train()
    assert "resuming from memory, step 5" in capfd.readouterr().err
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_a_resume_from_disk_with_no_snapshot_held_says_so_and_loses_one_step(tmp_path, capfd):
    """The node's memory lost after step 7: the run resumes from disk step 4 and says why;
    killed again right after step 5, before its first snapshot since was committed, it
    resumes from step 4 once more (one step lost) and says so again."""
    ref = reference(tmp_path)
    shm, run = tmp_path / "shm", tmp_path / "run"
    disk = {"every_n_steps": 4}
    with pytest.raises(Crash):
        Trainer(recipe(), trainer_args(run, shm, checkpoint=disk), callbacks=[CrashAt(7)]).train()
    for header in (shm / "rank00000").glob("*.json"):
        header.unlink()
    with pytest.raises(Crash):
        Trainer(recipe(), trainer_args(run, shm, checkpoint=disk), callbacks=[CrashAt(5)]).train()
    assert not steps_held(shm / "rank00000")
    model = recipe()
    Trainer(model, trainer_args(run, shm, checkpoint=disk)).train()
    said = capfd.readouterr().err
    assert said.count("memory snapshots: none is held (removed at the run's last normal end, "
                      "lost with its node's memory, or the run stopped before its first one "
                      "since it last started); resuming from disk step 4") == 2, said
    assert said.count("resuming from " + str(run / "checkpoints" / "step-00000004")) == 2, said
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_too_little_shared_memory_stops_before_the_first_step(tmp_path, monkeypatch):
    monkeypatch.setattr(snapshot_dirs, "free_bytes", lambda path: 1000)
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
    root = snapshot_dirs.snapshot_root(None, str(tmp_path), 0)
    assert root.startswith("/dev/shm/sailfin-")
    seen = []

    class Look(Callback):
        def on_step_end(self, trainer):
            mine = os.path.join(root, "rank00000")
            seen.append(steps_held(mine))

    args = make_args(tmp_path, epochs=1, train_batch_size=10, micro_batch_size=5,
                     checkpoint={"memory": {"every_n_steps": 1}})
    try:
        Trainer(recipe(), args, callbacks=[Settle(), Look()]).train()
    finally:
        survived = os.path.exists(root)
        snapshot_dirs.clean(str(tmp_path))  # a failed run leaves no RAM behind either
    assert not survived
    # Before step 3's snapshot: step 1's and step 2's, one in each set.
    assert sorted(seen[2].values()) == [1, 2]
    assert not os.path.exists(root)
    prefix = f"sailfin-{snapshot_dirs.run_id(str(tmp_path))}"
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
    assert trainer.checkpointer.args.async_save  # persisting saves are async
    assert (run / "checkpoints" / "step-00000004" / "manifest.json").exists()
    assert not (run / "checkpoints" / "step-00000006").exists()
    model = recipe()
    Trainer(model, trainer_args(run, shm, memory={"persist_every_n_steps": 4})).train()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert (run / "checkpoints" / "step-00000012" / "manifest.json").exists()


def test_a_snapshot_of_another_world_size_is_not_offered(tmp_path):
    store = SnapshotStore(str(tmp_path / "shm"), rank=0, world_size=1)
    store.take(4, facts(4, world_size=2), {"model": {"w": torch.ones(2)}, "trainer": {}}, {})
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


def test_what_a_load_checks_and_how_each_damage_is_named(tmp_path):
    """The header's CRC-32, the small state's CRC-32, the tensors' size and sampled
    CRC-32: each damage is a CheckpointCorrupt naming the file (resume falls back)."""
    store = SnapshotStore(str(tmp_path / "shm"), rank=0, world_size=1)
    weight = torch.randn(3_000_000)  # 12 MB: copied beside training, checked by samples
    store.take(1, facts(1), {"model": {"w": weight}, "trainer": {}},
               {"torch": torch.get_rng_state()}, later=lambda: frozenset(
                   {(weight.untyped_storage().data_ptr(), "cpu")}))
    assert store.settle() is True
    store.wait()
    where = store.inventory()[0][1]
    assert torch.equal(store.load(where)[1]["model"]["w"], weight)  # read back whole
    bin_ = tmp_path / "shm" / "rank00000" / f"{where.name}.bin"
    total, full, _ = read_header(where)["memory_snapshot"]["tensors"]
    # Copied at the step's end (the random state) whole; beside training, 4 KiB a MiB.
    for path, at, said in ((bin_, 7, "sampled CRC-32"), (bin_, full + (3 << 20) + 9,
                                                         "sampled CRC-32"),
                           (bin_, total - 1, "sampled CRC-32"),
                           (bin_.with_suffix(".pt"), 40, "CRC-32"),
                           (bin_.with_suffix(".json"), 3, "header")):
        flip(path, at)
        with pytest.raises(CheckpointCorrupt, match=said) as err:
            store.load(where)
        assert "\n" not in str(err.value) and str(path.name) in str(err.value)
        flip(path, at)  # mended
    os.truncate(bin_, 1000)
    with pytest.raises(CheckpointCorrupt, match="shorter"):
        store.load(where)
    bin_.unlink()
    with pytest.raises(CheckpointCorrupt, match="cannot be read"):
        store.load(where)
    assert store.inventory() == {}  # a lost buffer is never offered
    store.close()


def test_a_header_is_written_in_one_encoding_that_its_check_reads_back(tmp_path):
    """The header's file is one JSON encoding, keys sorted, with a CRC-32 of that text
    last; a value given as its JSON already (the run's config) goes in as it is, and a
    value elsewhere that spells its place does not take it."""
    from sailfin.checkpoint.snapshot_sets import Encoded, header_bytes

    config = {"seed": 3, "optim": {"lr": 0.1, "betas": [0.9, 0.99]}, "name": "x\u00e9\""}
    spelled = {"config": "\0", "note": '"config": "\0"'}
    for extra in ({}, {"recipe": spelled}):
        header = {"step": 7, "world_size": 2, "config": Encoded(json.dumps(config,
                                                                          sort_keys=True)),
                  **extra}
        where = Location(str(tmp_path), "a")
        open(where.path("json"), "wb").write(header_bytes(header))
        back = read_header(where)  # its CRC-32 checked
        assert back == {**header, "config": config, "crc32": back["crc32"]}
        text = open(where.path("json")).read()
        assert text.endswith(f'"crc32": {back["crc32"]}}}') and text.count("crc32") == 1
    with pytest.raises(CheckpointCorrupt, match="does not match its CRC-32"):
        open(where.path("json"), "w").write(text.replace('"seed": 3', '"seed": 4'))
        read_header(where)


def test_a_forged_small_state_runs_no_code(tmp_path):
    """A .pt that names a callable, with a header whose CRC-32s match it, is refused by
    the unpickler (it rebuilds plain values only): a one-line CheckpointCorrupt, nothing
    run."""
    import json
    import pickle

    from sailfin.checkpoint.snapshot_sets import header_crc
    from sailfin.utils.crc import crc32

    store = SnapshotStore(str(tmp_path / "shm"), rank=0, world_size=1)
    store.take(1, facts(1), {"model": {"w": torch.ones(4)}, "trainer": {}}, {})
    store.wait()
    where = store.inventory()[0][1]
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    blob = pickle.dumps({"layout": [], "state": Evil()})
    open(where.path("pt"), "wb").write(blob)
    header = json.loads(open(where.path("json")).read())
    header["memory_snapshot"]["state"] = [len(blob), crc32(blob)]
    header["crc32"] = header_crc(header)
    open(where.path("json"), "w").write(json.dumps(header))
    with pytest.raises(CheckpointCorrupt, match=rf"names {open.__module__}.open, which only arbitrary") as err:
        store.load(where)
    assert not marker.exists() and "\n" not in str(err.value)
    store.close()


def test_weights_a_non_finite_loss_spoiled_are_never_committed(tmp_path):
    """The losses are read late (as on a GPU or across processes: no sync per step), so
    steps go on after the NaN of global step 5; every snapshot taken with that loss
    unread is dropped, not committed, and the guard still names step 5."""
    from tests.trainer.test_nonfinite import NanAt
    from sailfin.trainer.safety.nonfinite import NonFiniteGuard, NonFiniteLossError

    shm = tmp_path / "shm"
    module = NanAt(IdData(100, 0), bad_steps={5})
    trainer = Trainer(module, make_args(
        tmp_path / "run", train_batch_size=10, log_every_n_steps=100,
        checkpoint={"at_epoch_end": False, "memory": {"every_n_steps": 1, "dir": str(shm)}}),
        callbacks=[Settle()])
    trainer.setup()
    trainer.nonfinite = NonFiniteGuard("stop", torch.device("cpu"), defer=True)
    with pytest.raises(NonFiniteLossError, match="global_step=5 "):
        trainer.train()
    assert trainer.global_step == 10  # read at the epoch's end: 5 steps after the NaN
    held = steps_held(shm / "rank00000")
    assert held and max(held.values()) == 5, held  # step 6 on: the spoiled weights
    snapshots_of(trainer).store.close()
    snapshot_dirs.clean(str(tmp_path / "run"))


def test_an_interrupt_during_the_commit_stops_the_run_at_once(tmp_path, monkeypatch):
    """The training thread commits a set copied on the CPU itself: a Ctrl-C (or
    SystemExit) that lands in the commit stops the run there, not as a "snapshot
    failed" error one step later; the set is not committed."""
    import sailfin.checkpoint.snapshots as snapshots

    store = SnapshotStore(str(tmp_path / "shm"), rank=0, world_size=1)

    def interrupted(self, *args):
        raise KeyboardInterrupt

    monkeypatch.setattr(snapshots.SnapshotStore, "_write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.take(1, facts(1), {"model": {"w": torch.ones(4)}, "trainer": {}}, {})
    assert store.committed.is_set() and store.inventory() == {}
    monkeypatch.undo()
    store.close()
