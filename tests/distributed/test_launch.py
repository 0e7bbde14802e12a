"""``sailfin launch``: torchrun's arguments, exit 75 when the job was preempted with a save.

Two CPU workers on loopback; SIGTERM to the launcher (what Kubernetes and Slurm
send) and to one worker; each run must exit 75 with a checkpoint of the step
where the workers stopped, and the same command again must resume from it.
A SIGTERM during set-up ends ``sailfin train`` with one line and 75, not -15.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from sailfin import signals
from sailfin.trainer.safety.preemption import PREEMPTED_EXIT_CODE
from tests.distributed.elastic_helpers import (ROOT, reached, stop, tail, wait, wait_until,
                                               write_config)


def launch(cfg, log, restarts=0):
    args = ["--nnodes=1", "--nproc-per-node=2", f"--max-restarts={restarts}",
            "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "--monitor-interval=0.1",
            "-m", "sailfin", "train", str(cfg), "--trainer.backend", "ddp"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with open(log, "ab") as fh:
        return subprocess.Popen([sys.executable, "-m", "sailfin", "launch", *args], env=env,
                                stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)


def test_the_exit_code_is_the_trainers():
    assert signals.PREEMPTED_EXIT_CODE == PREEMPTED_EXIT_CODE == 75


@pytest.mark.slow
@pytest.mark.parametrize("target", ["launcher", "worker"])
def test_sigterm_under_launch_exits_75_after_a_save(tmp_path, target):
    cfg = write_config(tmp_path, "job", every=100)  # no step saves: only the preemption one
    records, log = tmp_path / "job" / "records", tmp_path / "job.log"
    proc = launch(cfg, log)
    try:
        wait_until(lambda: reached(records, 0, "0-") >= 3, [proc], 180, [log], "step 3")
        if target == "launcher":
            proc.send_signal(signal.SIGTERM)
        else:
            [pid_file] = records.glob("pid-rank1-*")  # pid-rank1-<attempt>-pid<pid>
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        [code] = wait([proc], 120, [log])
    finally:
        stop(proc)
    text = log.read_text(errors="replace")
    assert code == 75, tail([log])
    assert "sailfin launch:" in text and "(exit code 75)" in text
    checkpoints = tmp_path / "job" / "run" / "checkpoints"
    latest = (checkpoints / "latest").read_text().strip()
    manifest = json.loads((checkpoints / latest / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["step"] >= 3


def test_sigterm_during_setup_is_one_line_and_75(tmp_path):
    """SIGTERM while the recipe is being built (before the trainer's handler exists)."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"""
data: {{class_path: tests.recipes.IdData, init_args: {{n_train: 20, n_val: 4}}}}
module: {{class_path: tests.recipes.SlowBuildRecipe, init_args: {{seconds: 30}}}}
trainer: {{epochs: 1, train_batch_size: 10, writers: [jsonl], output_dir: {tmp_path / 'out'}}}
""")
    ready = tmp_path / "building"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "SLOW_BUILD_MARKER": str(ready)}
    proc = subprocess.Popen([sys.executable, "-m", "sailfin", "train", str(cfg)], env=env,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 75, err
    assert "Traceback" not in err
    assert ("sailfin: stopped by SIGTERM during set-up, before the first step; nothing was "
            "lost") in err
    assert not (tmp_path / "out" / "checkpoints").exists()


def _slow_build_config(tmp_path, only_rank=-1, seconds=60):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"""
data: {{class_path: tests.recipes.IdData, init_args: {{n_train: 20, n_val: 4}}}}
module: {{class_path: tests.recipes.SlowBuildRecipe,
          init_args: {{seconds: {seconds}, only_rank: {only_rank}}}}}
trainer: {{epochs: 1, train_batch_size: 10, writers: [jsonl], output_dir: {tmp_path / 'out'},
           distributed: {{timeout_seconds: 600}}}}
""")
    return cfg


def _when_building(proc, ready, what):
    deadline = time.monotonic() + 90
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, what()
        time.sleep(0.05)


def test_a_first_ctrl_c_during_setup_is_the_first(tmp_path):
    """(#34) It used to say 'aborted by a second Ctrl-C' and exit 130."""
    cfg = _slow_build_config(tmp_path)
    ready = tmp_path / "building"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "SLOW_BUILD_MARKER": str(ready)}
    proc = subprocess.Popen([sys.executable, "-m", "sailfin", "train", str(cfg)], env=env,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        _when_building(proc, ready, lambda: proc.stderr.read())
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 75, err
    assert err.splitlines() == [
        "sailfin: stopped by SIGINT during set-up, before the first step; nothing was lost: "
        "run the same command again to start (or resume) (exit code 75)"], err


def test_the_setup_handler_tells_a_copy_from_a_second_ctrl_c(monkeypatch):
    """torchrun passes the terminal's Ctrl-C on: a copy within a second is the same stop."""
    stop = signals._SetupStop()
    now = [100.0]
    monkeypatch.setattr(signals.time, "monotonic", lambda: now[0])
    with pytest.raises(signals.StoppedDuringSetup, match="stopped by SIGINT during set-up"):
        stop.on_signal(signal.SIGINT, None)
    now[0] += 0.3
    stop.on_signal(signal.SIGINT, None)   # the copy: nothing
    stop.on_signal(signal.SIGTERM, None)  # the agent's SIGTERM after it: nothing
    now[0] += 2.0
    with pytest.raises(KeyboardInterrupt):
        stop.on_signal(signal.SIGINT, None)  # a second press


STUCK = """
import sys, datetime
import torch.distributed as dist
from sailfin import signals
signals.STUCK_SECONDS = 1.0
with signals.stop_during_setup(end_stuck=True):  # a process of its own, as the command
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True,
                          timeout=datetime.timedelta(seconds=120))
    open(sys.argv[1], "w").close()
    store.get("a key no one writes")  # blocked in C: Python's handler never runs
"""


def test_a_setup_blocked_in_c_still_ends_with_75_at_once(tmp_path):
    """A rank waiting in the process group for a peer: SIGTERM used to wait for torchrun's
    SIGKILL 30 s later (exit 143 from the launcher)."""
    ready = tmp_path / "blocked"
    proc = subprocess.Popen([sys.executable, "-c", STUCK, str(ready)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stderr=subprocess.PIPE, text=True)
    try:
        _when_building(proc, ready, lambda: proc.stderr.read())
        time.sleep(0.3)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 75, err
    assert "sailfin: stopped by SIGTERM during set-up, before the first step" in err
    assert 0.9 < took < 10, took


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_while_rank_0_builds_gives_75_at_once(tmp_path, sig):
    """Rank 0 builds its model, rank 1 waits for it in the process group (blocked in C)."""
    cfg = _slow_build_config(tmp_path, only_rank=0, seconds=120)
    ready, log = tmp_path / "building", tmp_path / "launch.log"
    args = ["--nnodes=1", "--nproc-per-node=2", "--max-restarts=0", "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:0", "--monitor-interval=0.1", "-m", "sailfin", "train",
            str(cfg), "--trainer.backend", "ddp"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "SLOW_BUILD_MARKER": str(ready)}
    with open(log, "ab") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "sailfin", "launch", *args], env=env,
                                stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
    try:
        _when_building(proc, ready, lambda: tail([log]))
        time.sleep(3)  # rank 1 is built and waits for rank 0 in the process group
        sent = time.monotonic()
        proc.send_signal(sig)
        [code] = wait([proc], 60, [log])
        took = time.monotonic() - sent
    finally:
        stop(proc)
    text = log.read_text(errors="replace")
    assert code == 75, tail([log])
    assert took < 20, (took, tail([log]))  # torchrun's SIGKILL comes after 30 s
    name = signal.Signals(sig).name
    assert text.count(f"sailfin: stopped by {name} during set-up, before the first step") == 2
    assert "Traceback" not in text and "second Ctrl-C" not in text, text
    assert (f"sailfin launch: stopped by {name}; 0 of 2 worker(s) saved a checkpoint, the "
            "others had not begun training or had finished it: nothing was lost") in text


@pytest.mark.slow
@pytest.mark.parametrize("failing", ["Rank0DiskFull", "Rank1DiskFull"])
def test_a_save_failing_on_one_rank_is_its_line_and_exit_2(tmp_path, failing):
    """Rank 0's commit or rank 1's shards meet a full disk: one line, the other rank stops
    without a traceback, and the launcher exits 2. Rank 0's commit is its own failure, so
    rank 0 prints it; rank 1's shards fail DCP's save on every rank (the small state is
    in the same save), and rank 0 says that once for all."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"""
data: {{class_path: tests.recipes.IdData, init_args: {{n_train: 40, n_val: 4}}}}
module: {{class_path: tests.recipes.LinearRecipe}}
trainer: {{epochs: 1, train_batch_size: 10, writers: [jsonl], output_dir: {tmp_path / 'out'},
           checkpoint: {{every_n_steps: 1, class_path: tests.checkpoint.helpers.{failing}}}}}
""")
    log = tmp_path / "launch.log"
    args = ["--nnodes=1", "--nproc-per-node=2", "--max-restarts=0", "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:0", "--monitor-interval=0.1", "-m", "sailfin", "train",
            str(cfg), "--trainer.backend", "ddp"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with open(log, "ab") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "sailfin", "launch", *args], env=env,
                                stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
    try:
        [code] = wait([proc], 120, [log])
    finally:
        stop(proc)
    text = log.read_text(errors="replace")
    rank = 0  # the commit's rank, or the one that tells a failure every rank shares
    assert code == 2, tail([log])
    errors = [line for line in text.splitlines() if line.startswith("sailfin: checkpoint error")]
    assert len(errors) == 1 and "saving step 2 to" in errors[0] \
        and "no space left on device" in errors[0], text
    assert (f"sailfin launch: rank {rank} stopped on the error it printed above; torchrun "
            "stopped any other worker (exit code 2)") in text
    assert "Traceback" not in text, text


def test_the_closing_line_comes_from_the_workers_notes():
    from sailfin.launch import _closing_line

    def notes(**kinds):
        out = {k: set() for k in ("training", "preempted", "finished", "hang", "error")}
        out.update({k: set(v) for k, v in kinds.items()})
        return out

    # The watchdog ended the job; the frozen rank was SIGKILLed: a hang, not a preemption.
    line, code = _closing_line({0: -9, 1: 75}, notes(training={0, 1}, hang={1}))
    assert code == 75 and line.startswith("the hang watchdog ended the job")
    assert "saved a checkpoint" not in line
    # Exit 75 without any note (a hang before this launcher's notes): torchrun's report.
    assert _closing_line({0: 75, 1: 75}, notes(training={0, 1})) == (None, 75)
    # Rank 1 printed a user error; rank 0's collective broke (1) or the agent stopped it.
    for other in (1, -15):
        line, code = _closing_line({0: other, 1: 2}, notes(training={0, 1}, error={1}))
        assert code == 2 and line.startswith("rank 1 stopped on the error it printed above")
    # Rank 0 found the run already finished (the others too, or the agent stopped them).
    line, code = _closing_line({0: 3, 1: -15}, notes(training=set(), error={0}))
    assert code == 3 and line.startswith("rank 0 stopped on the error it printed above")
    # Every stopped worker saved (or stopped before training): a preemption.
    line, code = _closing_line({0: 75, 1: -15},
                               notes(training={0, 1}, preempted={0, 1}))
    assert code == 75 and "2 saved a checkpoint" in line
    # A failure that is none of these: torchrun's own report, and its code.
    assert _closing_line({0: 1, 1: -15}, notes(training={0, 1})) == (None, 1)


SHORT = """
data: {{class_path: tests.recipes.IdData, init_args: {{n_train: 40, n_val: 4}}}}
module: {{class_path: tests.recipes.LinearRecipe}}
trainer: {{epochs: 1, train_batch_size: 10, writers: [jsonl], output_dir: {out},
           progress: none}}
"""
RDZV = ["--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0"]


def test_a_sailfin_command_where_torchrun_takes_a_script_is_run_with_m_sailfin(tmp_path,
                                                                               monkeypatch):
    """`sailfin launch --nproc-per-node 2 train config.yaml` ran `python train` (torchrun's
    "can't open file .../train", exit 2 twice per rank)."""
    from torch.distributed.run import parse_args

    from sailfin.launch import sailfin_command

    args = parse_args([*RDZV, "train", "c.yaml", "--trainer.epochs", "2"])
    assert sailfin_command(args, [], ("train", "report")) is None
    assert (args.module, args.training_script, args.training_script_args) == (
        True, "sailfin", ["train", "c.yaml", "--trainer.epochs", "2"])
    script = tmp_path / "train.py"
    args = parse_args([*RDZV, str(script), "x"])  # a script stays a script
    assert sailfin_command(args, [], ("train",)) is None and not args.module
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train").mkdir()  # a folder of the same name: still the command
    args = parse_args([*RDZV, "train", "c.yaml"])
    assert sailfin_command(args, [], ("train",)) is None and args.module
    (tmp_path / "train" / "__main__.py").write_text("")  # python can run this one
    args = parse_args([*RDZV, "train", "c.yaml"])
    assert sailfin_command(args, [], ("train",)) is None and not args.module


def test_a_config_where_the_script_goes_is_refused_in_one_line_showing_the_form(
        tmp_path, capsys):
    from sailfin.cli import main

    cfg = tmp_path / "c.yaml"
    assert main(["launch", *RDZV, str(cfg), "--trainer.epochs", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"sailfin launch: {cfg} is a config, not a script torchrun can run; name "
                   f"the command before it: sailfin launch {' '.join(RDZV)} -m sailfin train "
                   f"{cfg} --trainer.epochs 2"]


@pytest.mark.slow
def test_launch_train_config_and_the_advised_form_train_two_ranks(tmp_path, capsys):
    import shlex

    from sailfin.cli import main

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for name in ("short", "advised"):
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(SHORT.format(out=tmp_path / name))
        if name == "short":  # as a user types it first
            argv = ["sailfin", "launch", *RDZV, "train", str(cfg), "--trainer.backend", "ddp"]
        else:
            capsys.readouterr()
            assert main(["launch", *RDZV, str(cfg), "--trainer.backend", "ddp"]) == 2
            argv = shlex.split(capsys.readouterr().err.split("name the command before it: ")[1])
        done = subprocess.run([sys.executable, "-m", *argv], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["global_step"] == 4 and summary["world_size"] == 2, summary


def test_the_launcher_watch_tells_once_when_the_parent_changes():
    from sailfin.distributed.launcher_watch import LauncherWatch, parent_gone

    told = []
    here = LauncherWatch(told.append, interval=0.01)  # this process's parent: alive
    here.start()
    time.sleep(0.1)
    here.stop()
    assert told == [] and not parent_gone(os.getppid(), wait=0.05)
    gone = LauncherWatch(told.append, interval=0.01, parent=os.getppid() + 1)  # not ours
    gone.start()
    deadline = time.monotonic() + 10
    while not told and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gone.check() and told == [os.getppid() + 1]  # once, from the thread
    gone.stop()


WORKER_OF_A_DYING_LAUNCHER = """
import os, sys, time
import sailfin.signals  # the command's start: the launcher is noted
first = os.getppid()
print(first, flush=True)
sys.stdin.read()  # the launcher is gone (its end of the pipe closed)
while os.getppid() == first:
    time.sleep(0.01)
from sailfin.distributed.launcher_watch import LauncherWatch
told = []
print(LauncherWatch(told.append).check(), told == [first], flush=True)
"""


def test_a_launcher_that_dies_while_the_worker_sets_up_is_still_noticed():
    """The launcher is the parent when the command began, not when training begins."""
    launcher = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', sys.argv[1]], "
                "stdin=subprocess.PIPE); sys.stdout.flush()")
    import select

    proc = subprocess.Popen([sys.executable, "-c", launcher + "; import time; time.sleep(1)",
                             WORKER_OF_A_DYING_LAUNCHER], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    first = proc.stdout.readline().split()  # the worker's parent: the launcher
    assert first == [str(proc.pid)]
    proc.wait(timeout=60)  # the launcher ends; the worker is handed to another process
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    assert ready and proc.stdout.readline().split() == ["True", "True"]
    proc.stdout.close()


# Starts the launcher and reaps every process below it, the workers a killed launcher
# leaves included (a sub-reaper: they are handed to it), recording each one's exit code.
REAPER = r"""
import ctypes, json, os, subprocess, sys
assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
launcher = subprocess.Popen(sys.argv[2:])
with open(sys.argv[1] + ".pid", "w") as fh:
    fh.write(str(launcher.pid))
codes = {}
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        break
    codes[pid] = os.waitstatus_to_exitcode(status)
with open(sys.argv[1], "w") as fh:
    json.dump(codes, fh)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a sub-reaper: Linux")
@pytest.mark.parametrize("launcher", ["torchrun", "sailfin launch"])
def test_workers_of_a_killed_launcher_save_and_stop_with_one_line(tmp_path, launcher):
    """kill -9 of the launcher left its workers (each in a session of its own) training
    to the end, writing checkpoints and the final model unsupervised."""
    from tests.distributed.elastic_helpers import pid_of, single_node

    cfg = write_config(tmp_path, "job", every=100, step_seconds=0.3, epochs=20)  # 240 steps
    records, log, codes = tmp_path / "job" / "records", tmp_path / "job.log", tmp_path / "codes"
    start = (["-m", "torch.distributed.run"] if launcher == "torchrun"
             else ["-m", "sailfin", "launch"])
    (tmp_path / "tmp").mkdir()  # the killed launcher's notes and logs: removed with it
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmp_path / "tmp")}
    with open(log, "ab") as fh:
        reaper = subprocess.Popen([sys.executable, "-c", REAPER, str(codes), sys.executable,
                                   *start, *single_node(2, cfg, restarts=0)],
                                  env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
                                  start_new_session=True)
    try:
        wait_until(lambda: reached(records, 0, "0-") >= 3, [reaper], 180, [log], "step 3")
        launcher_pid = int((tmp_path / "codes.pid").read_text())
        before = len(log.read_bytes())
        os.kill(launcher_pid, signal.SIGKILL)
        killed_at = reached(records, 0, "0-")
        wait([reaper], 120, [log])  # the workers stopped: the reaper reaped them all
    finally:
        stop(reaper)
    exits = {int(pid): code for pid, code in json.loads(codes.read_text()).items()}
    workers = [pid_of(records, rank, "0-w2") for rank in (0, 1)]
    assert exits[launcher_pid] == -signal.SIGKILL
    assert [exits[pid] for pid in workers] == [75, 75], tail([log])
    # Stopped at a step boundary soon after (the ranks agree every 10 steps), with a save.
    checkpoints = tmp_path / "job" / "run" / "checkpoints"
    manifest = json.loads((checkpoints / (checkpoints / "latest").read_text().strip()
                           / "manifest.json").read_text())
    assert killed_at <= manifest["step"] <= killed_at + 12 and manifest["step"] < 240
    assert reached(records, 0, "0-") == reached(records, 1, "0-") == manifest["step"]
    assert not (tmp_path / "job" / "run" / "final").exists()
    text = log.read_bytes()[before:].decode(errors="replace")
    # sailfin's one line. (torch's C++ store client may warn of the broken connection to
    # the launcher's store, when a watchdog's request was in flight as the launcher died.)
    assert "Traceback" not in text and "hang watchdog" not in text, tail([log])
    assert [x for x in text.splitlines() if x.startswith("sailfin")] == [f"sailfin: stopped by the loss of its launcher (pid {launcher_pid}) after "
                    f"step {manifest['step']}; saved checkpoint {checkpoints}/step-"
                    f"{manifest['step']:08d}. Run the same command again to resume from it "
                    "(exit code 75)"], tail([log])
