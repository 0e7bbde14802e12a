"""A save stopped at any of its file operations, and a save that meets a full disk.

A child process saves with a storage that ends the process (``os._exit``, as
abrupt as SIGKILL: no cleanup, no ``finally``) before its K-th rename, write,
directory creation or removal, or DCP's writing of the shard files (small state
included) or of their index; K runs over every operation of the save. The next
start must find the newest checkpoint that was complete when it died.
"""

import errno
import multiprocessing
import os
import time

import pytest
import torch

from sailfin import Trainer
from sailfin.checkpoint import CheckpointError, DirectoryCheckpointer, SaveRequest
from sailfin.checkpoint.storage import LocalStorage
from sailfin.config import CheckpointArguments
from sailfin.distributed import DistEnv
from tests.checkpoint.helpers import saved_model
from tests.recipes import IdData, LinearRecipe, args

OPS = ("makedirs", "write_bytes", "rename_dir", "remove", "remove_tree")


class StopAt(LocalStorage):
    """LocalStorage that ends the process before its ``stop_at``-th operation (0: never)
    and counts the operations in ``calls``."""

    def __init__(self, stop_at: int = 0) -> None:
        self.stop_at, self.calls = stop_at, 0

    def _tick(self) -> None:
        self.calls += 1
        if self.calls == self.stop_at:
            os._exit(9)


for _op in OPS:
    def _counted(self, *a, _name=_op, **kw):
        self._tick()
        return getattr(LocalStorage, _name)(self, *a, **kw)
    setattr(StopAt, _op, _counted)


class Ticking(DirectoryCheckpointer):
    """Its DCP writes count as operations of its storage too: before the shard files are
    written, once they are (not yet indexed), and before the index ``.metadata``."""

    def shard_writer(self, path):
        writer = super().shard_writer(path)
        tick = getattr(self.storage, "_tick", None)
        if tick is None:
            return writer
        write_data, finish = writer.write_data, writer.finish

        def ticked_write(plan, planner):
            tick()
            done = write_data(plan, planner)
            tick()
            return done

        def ticked_finish(metadata, results):
            tick()
            return finish(metadata, results)
        writer.write_data, writer.finish = ticked_write, ticked_finish
        return writer


def snapshot(step: int, value: float) -> SaveRequest:
    facts = {"step": step, "epoch": 0, "step_in_epoch": step, "samples_seen": step,
             "world_size": 1}
    # The model goes through DCP (shards/), as every backend saves it.
    return SaveRequest(step, facts, {"trainer": {"value": value}}, {"rng": torch.arange(2)},
                    sharded={"module": {"w": torch.full((3,), value)}})


def checkpointer(root, storage=None) -> DirectoryCheckpointer:
    ckpt = Ticking(str(root), CheckpointArguments(keep_last=1), DistEnv())
    if storage is not None:
        ckpt.storage = ckpt.shards.storage = storage
    return ckpt


def _save_in_child(root, stop_at, step, value):
    checkpointer(root, StopAt(stop_at)).save(snapshot(step, value))
    os._exit(0)


def save_and_stop(root, stop_at, step, value) -> int:
    proc = multiprocessing.get_context("fork").Process(
        target=_save_in_child, args=(str(root), stop_at, step, value))
    proc.start()
    proc.join(60)
    return proc.exitcode


def complete_on_disk(root) -> list[tuple[int, float]]:
    """(step, value) of every directory holding a manifest, whatever its name."""
    found = []
    for entry in os.listdir(root):
        if os.path.exists(root / entry / "manifest.json"):
            w = saved_model(root / entry, {"w": torch.zeros(3)})["w"]
            found.append((int(entry.rsplit("-", 1)[1]), float(w[0])))
    return sorted(found)


def operations(root, step, value) -> int:
    storage = StopAt()
    checkpointer(root, storage).save(snapshot(step, value))
    return storage.calls


@pytest.mark.parametrize("scenario", ["new step", "same step again"])
def test_a_save_stopped_at_every_operation_resumes_from_the_newest_complete(tmp_path,
                                                                            scenario):
    step, value = (6, 2.0) if scenario == "new step" else (3, 2.0)
    count = tmp_path / "count"
    checkpointer(count).save(snapshot(3, 1.0))
    n = operations(count, step, value)
    assert n >= 8
    for stop_at in range(1, n + 2):
        root = tmp_path / f"stop-{stop_at}"
        checkpointer(root).save(snapshot(3, 1.0))
        code = save_and_stop(root, stop_at, step, value)
        assert code == (9 if stop_at <= n else 0)
        on_disk = complete_on_disk(root)
        newest_step = max(s for s, _ in on_disk)
        # Of two complete saves of one step, the newer (value 2.0) wins once written.
        newest_value = max(v for s, v in on_disk if s == newest_step)
        ckpt = checkpointer(root)
        ckpt.recover()
        name = ckpt.latest()
        assert name is not None, f"stopped before operation {stop_at}: nothing to resume"
        loaded = ckpt.load(name)
        assert loaded.manifest["step"] == newest_step, f"stopped before operation {stop_at}"
        assert float(saved_model(loaded.location, {"w": torch.zeros(3)})["w"][0]) == \
            newest_value, stop_at
        # The next save tidies what the stopped one left.
        ckpt.save(snapshot(9, 3.0))
        assert sorted(os.listdir(root)) == ["latest", "step-00000009"], stop_at


def test_latest_catches_up_with_a_checkpoint_committed_after_it(tmp_path):
    ckpt = checkpointer(tmp_path)
    ckpt.save(snapshot(3, 1.0))
    time.sleep(0.01)
    ckpt.args.keep_last = None
    ckpt.save(snapshot(6, 2.0))
    (tmp_path / "latest").write_text("step-00000003\n")  # as if stopped before the pointer
    os.utime(tmp_path / "latest", (1, 1))
    ckpt.recover()
    assert ckpt.latest() == "step-00000006"
    # Resumed from step 3 on purpose and saved: latest, newer than step 6, stays.
    (tmp_path / "latest").write_text("step-00000003\n")
    ckpt.recover()
    assert ckpt.latest() == "step-00000003"


class NoSpace(LocalStorage):
    """A disk that fills up while the manifest of step ``full_at`` is written (the
    shards, written first, fit): the commit fails."""

    full_at = 4

    def write_bytes(self, path, data):
        if f"step-{self.full_at:08d}" in path and path.endswith("manifest.json"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write_bytes(path, data)


def test_a_full_disk_fails_in_one_line_and_keeps_the_previous_checkpoint(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr("sailfin.checkpoint.checkpointer.open_storage",
                        lambda location, options=None: (NoSpace(), os.path.abspath(location)))
    trainer = Trainer(LinearRecipe(IdData(40, 6)),
                      args(tmp_path, epochs=2, checkpoint={"every_n_steps": 2,
                                                          "at_epoch_end": False}))
    with pytest.raises(CheckpointError) as info:
        trainer.train()
    message = str(info.value)
    root = tmp_path / "checkpoints"
    assert "no space left" in message and "step 4" in message and str(root) in message
    assert "step-00000002 is kept" in message and "\n" not in message
    assert sorted(os.listdir(root)) == ["latest", "step-00000002"]  # no partial save left



def test_a_run_killed_before_its_first_save_is_not_logged_twice(tmp_path, capfd):
    from tests.checkpoint.helpers import Crash, CrashAt, metric_lines

    def run(callbacks=()):
        trainer = Trainer(LinearRecipe(IdData(40, 6)),
                          args(tmp_path, epochs=1, checkpoint={"at_epoch_end": True}),
                          callbacks=list(callbacks))
        try:
            trainer.train()
        except Crash:
            pass

    run([CrashAt(2)])  # killed before any checkpoint: steps 1 and 2 are logged
    run()
    steps = [e["step"] for e in metric_lines(tmp_path) if e["split"] == "train"]
    assert steps == [1, 2, 3, 4]
    assert "dropping 2 metrics.jsonl line(s)" in capfd.readouterr().err
