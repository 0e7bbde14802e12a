"""A memory snapshot belongs to the run that wrote it: resumed only by that run, never
after its output directory is gone, never by a run with another output directory, never
while a writer is alive; ``resume: never`` does not mention it; a refusal names what
exists."""

import json
import os
import shutil

import pytest
import torch

from sailfin import Trainer
from sailfin.checkpoint import CheckpointError, snapshot_dirs
from sailfin.trainer.checkpointing.config_diff import ConfigChanged
from tests.checkpoint.test_kill import kill, start, wait_for, write_config
from tests.checkpoint.test_memory import Crash, CrashAt, Settle, recipe, reference, trainer_args


def crash(out, shm, step=7, **kw):
    with pytest.raises(Crash):
        Trainer(recipe(), trainer_args(out, shm, **kw), callbacks=[Settle(), CrashAt(step)]).train()


def fresh_run(out, shm, capfd, **kw):
    """Train to the end; (the model, the first step trained, what was said on stderr)."""
    model = recipe()
    Trainer(model, trainer_args(out, shm, **kw)).train()
    return model, model.events[0], capfd.readouterr().err


def same_as(model, ref):
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_the_identity_is_in_the_output_dir_and_in_every_snapshot(tmp_path):
    out, shm = tmp_path / "run", tmp_path / "shm"
    crash(out, shm)
    run = json.loads((out / snapshot_dirs.IDENTITY).read_text())["run"]
    assert len(run) == 16
    headers = [n for n in os.listdir(shm / "rank00000") if n.endswith(".json")]
    assert sorted(headers) == ["a.json", "b.json"]
    for name in headers:
        header = json.loads((shm / "rank00000" / name).read_text())
        assert header["memory_snapshot"]["run"] == run


def test_a_deleted_output_dir_never_comes_back_from_memory(tmp_path, capfd):
    ref = reference(tmp_path)
    out, shm = tmp_path / "run", tmp_path / "shm"
    crash(out, shm)
    shutil.rmtree(out)
    capfd.readouterr()
    model, first, err = fresh_run(out, shm, capfd)
    assert "resuming from memory" not in err
    assert f"removed {shm}: its snapshots belong to another run (written before this " \
        "output directory was deleted" in err
    assert first[1] == 0  # its first event is at step 0: nothing was skipped
    assert len(model.step_ids) == 15  # every step trained in this run
    same_as(model, ref)


def test_another_output_dir_never_resumes_a_dead_runs_snapshot(tmp_path, capfd):
    ref = reference(tmp_path)
    shm = tmp_path / "shm"
    crash(tmp_path / "first", shm)
    capfd.readouterr()
    model, _, err = fresh_run(tmp_path / "second", shm, capfd)
    assert "resuming from memory" not in err
    assert f"written by the run of {tmp_path / 'first'}" in err
    assert len(model.step_ids) == 15
    same_as(model, ref)


def test_a_live_writer_keeps_its_directory(tmp_path):
    """A run with another output dir but the same memory.dir, while the first runs."""
    shm = tmp_path / "shm"
    config = write_config(tmp_path, "first", step_seconds=0.2, checkpoint=(
        f"keep_last: 2, memory: {{every_n_steps: 1, dir: '{shm}'}}"))
    proc = start(config, tmp_path / "first.log")
    try:
        assert wait_for(lambda: (shm / "rank00000").is_dir() and any(
            n.endswith(".json") for n in os.listdir(shm / "rank00000")), proc)
        model = recipe()
        with pytest.raises(CheckpointError) as err:
            Trainer(model, trainer_args(tmp_path / "second", shm)).train()
        assert proc.poll() is None  # the first run still trains
    finally:
        kill(proc)
    text = str(err.value)
    assert "\n" not in text
    assert f"{shm} is in use by the run writing {tmp_path / 'first'} (pid {proc.pid}" in text
    assert "trainer.checkpoint.memory.dir" in text
    assert model.step_ids == []  # not one step


def test_resume_never_does_not_mention_memory(tmp_path, capfd):
    ref = reference(tmp_path)
    out, shm = tmp_path / "run", tmp_path / "shm"
    crash(out, shm)
    capfd.readouterr()
    model, _, err = fresh_run(out, shm, capfd, resume="never")
    assert "from memory" not in err and "step 6" not in err
    assert len(model.step_ids) == 15
    same_as(model, ref)


def test_a_refused_resume_names_what_exists(tmp_path):
    out, shm = tmp_path / "run", tmp_path / "shm"
    crash(out, shm)
    assert not (out / "checkpoints").exists()  # only memory snapshots
    with pytest.raises(ConfigChanged) as err:
        Trainer(recipe(), trainer_args(out, shm, seed=5)).train()
    text = str(err.value)
    assert f"run `sailfin clean {out}` (its memory snapshots in {shm})" in text
    assert "checkpoints" not in text
