"""One run per output directory: a second run stops at once; a dead run's lock is taken over."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sailfin import Trainer
from sailfin.cli import main
from sailfin.trainer.safety.run_lock import LOCK_NAME, RunLock, RunLockError
from tests.recipes import IdData, LinearRecipe, args

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """
data: {class_path: tests.recipes.IdData, init_args: {n_train: 20, n_val: 4}}
module: {class_path: tests.recipes.LinearRecipe}
trainer: {epochs: 1, train_batch_size: 10, writers: [jsonl], output_dir: OUT}
"""


def holder(out, then="sleep"):
    """A process that takes the lock, prints 'locked', then sleeps or dies by SIGKILL."""
    code = ("import os, sys, time\nfrom sailfin.trainer.safety.run_lock import RunLock\n"
            f"lock = RunLock({str(out)!r}).acquire()\nprint('locked', flush=True)\n"
            + ("time.sleep(60)\n" if then == "sleep" else "os.kill(os.getpid(), 9)\n"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env)
    assert proc.stdout.readline().strip() == b"locked"
    return proc


def test_a_second_run_into_the_same_directory_stops_naming_the_owner(tmp_path, capsys):
    out = tmp_path / "out"
    proc = holder(out)
    try:
        config = tmp_path / "run.yaml"
        config.write_text(CONFIG.replace("OUT", str(out)))
        assert main(["train", str(config)]) == 2
        err = capsys.readouterr().err
        assert f"{out} is in use by another run (pid {proc.pid} on host" in err
        assert "Traceback" not in err
        assert not (out / "metrics.jsonl").exists()  # stopped before writing anything
        with pytest.raises(RunLockError, match=f"pid {proc.pid}"):
            Trainer(LinearRecipe(IdData(20, 4)), args(out)).train()
    finally:
        proc.kill()
        proc.wait()


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_line(tmp_path, capfd):
    out = tmp_path / "out"
    proc = holder(out, then="die")
    assert proc.wait() == -9
    owner = json.loads((out / LOCK_NAME).read_text())
    assert owner["pid"] == proc.pid and owner["host"] and owner["started"]
    trainer = Trainer(LinearRecipe(IdData(20, 4)), args(out))
    trainer.train()
    err = capfd.readouterr().err
    assert "took over the lock" in err and f"pid {proc.pid}" in err
    assert (out / LOCK_NAME).read_text() == ""  # released at the end of the run
    Trainer(LinearRecipe(IdData(20, 4)), args(out)).train()
    assert "took over" not in capfd.readouterr().err


def test_the_lock_is_held_for_the_run_and_released_by_close(tmp_path):
    trainer = Trainer(LinearRecipe(IdData(20, 4)), args(tmp_path))
    trainer.setup()
    with pytest.raises(RunLockError):
        RunLock(str(tmp_path)).acquire()
    trainer.close()
    RunLock(str(tmp_path)).acquire().release()


def test_a_stop_while_the_lock_is_taken_leaves_no_takeover_note(tmp_path, monkeypatch, capsys):
    """SIGTERM lands while set-up takes the lock (its owner line written, not yet fsynced):
    the stop is clean (75), so the next start takes the lock without 'took over ...
    (killed?)'."""
    import signal

    from sailfin.cli import main
    from sailfin.trainer.safety import run_lock

    path = tmp_path / "run.yaml"
    path.write_text("data: {class_path: tests.recipes.IdData, init_args: {n_train: 20}}\n"
                    "module: {class_path: tests.recipes.LinearRecipe}\n"
                    f"trainer: {{output_dir: {tmp_path / 'out'}, writers: [jsonl], "
                    "train_batch_size: 10}\n")
    fsync = run_lock.os.fsync
    stops = []

    def stop_once(fd):
        fsync(fd)
        if not stops and os.readlink(f"/proc/self/fd/{fd}").endswith(LOCK_NAME):
            stops.append(fd)
            signal.raise_signal(signal.SIGTERM)  # the set-up handler raises here

    monkeypatch.setattr(run_lock.os, "fsync", stop_once)
    assert main(["train", str(path)]) == 75 and stops
    assert "stopped by SIGTERM during set-up" in capsys.readouterr().err
    assert (tmp_path / "out" / run_lock.LOCK_NAME).read_text() == ""
    assert main(["train", str(path)]) == 0
    assert "took over the lock" not in capsys.readouterr().err
