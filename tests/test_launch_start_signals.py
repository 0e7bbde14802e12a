"""A stop while ``sailfin launch`` (or ``sailfin train``) is still starting: importing
torch, joining the rendezvous. From the command's first instruction SIGTERM and Ctrl-C
end it with one line and exit 75 (what a Slurm script waiting for 75 requeues), never a
``KeyboardInterrupt`` traceback, an ``ImportError`` or a bare -15."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sailfin.signals import STUCK_SECONDS

ROOT = Path(__file__).resolve().parents[1]
CONFIG = """data: {class_path: tests.recipes.IdData, init_args: {n_train: 200, n_val: 4}}
module: {class_path: tests.recipes.LinearRecipe}
trainer: {epochs: 1, train_batch_size: 10, writers: [jsonl], output_dir: OUT, progress: none}
"""


def _handles_sigterm(pid: int) -> bool:
    """Whether the process caught SIGTERM yet (/proc's SigCgt mask): Python catches SIGINT
    at start-up by itself, SIGTERM only once the command's first instruction ran."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(int(line.split()[1], 16) for line in status.splitlines()
                if line.startswith("SigCgt:"))
    return bool(mask >> (signal.SIGTERM - 1) & 1)


def _start(tmp_path: Path, command: list[str], script: bool = False) -> subprocess.Popen:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG.replace("OUT", str(tmp_path / "out")))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    start = ["-m", "sailfin"]
    if script:  # the console script pip writes, as a user types `sailfin train ...`
        (tmp_path / "sailfin").write_text(console_script())
        start = [str(tmp_path / "sailfin")]
    args = [sys.executable, *start, *command, str(cfg)]
    return subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


LAUNCH = ["launch", "--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=c10d",
          "--rdzv-endpoint=127.0.0.1:0", "-m", "sailfin", "train"]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
@pytest.mark.parametrize("command", ["launch", "train", "script train"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("after", [0.0, 0.3])  # at the first instruction; in torch's import
def test_a_stop_while_starting_is_one_line_and_75(tmp_path, command, sig, after):
    proc = _start(tmp_path, LAUNCH if command == "launch" else ["train"],
                  script=command.startswith("script"))
    try:
        deadline = time.monotonic() + 30
        while not _handles_sigterm(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.001)
        # Handled before torch loads (its library would be mapped into the process).
        assert "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text()
        time.sleep(after)
        proc.send_signal(sig)  # to the command itself (no worker has started yet)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = err.strip().splitlines()
    assert proc.returncode == 75 and len(lines) == 1, (proc.returncode, err)
    name = signal.Signals(sig).name
    who = "sailfin launch" if command == "launch" else "sailfin"
    assert lines[0].startswith(f"{who}: stopped by {name}") and lines[0].endswith(
        "(exit code 75)"), lines[0]
    assert "nothing was lost" in lines[0]


SWALLOWING_IMPORT = '''
import pathlib, time
pathlib.Path(__file__).with_name("importing").touch()
end = time.monotonic() + 60
while time.monotonic() < end:  # work in a library's import under a bare except (dill's)
    try:
        time.sleep(0.1)
    except:
        pass
from tests.recipes import LinearRecipe as Recipe
'''


# What ``sailfin launch`` runs until torchrun takes the signals over, with an import.
LAUNCH_IMPORTING = ("import sys; sys.argv[1:] = ['launch']; from sailfin.signals import "
                    "stop_at_start; stop_at_start(); import swallowing")


@pytest.mark.parametrize("command", ["train", "launch"])
def test_a_stop_while_a_module_with_a_bare_except_imports_ends_at_once(tmp_path, command):
    """A module swallows any exception while it imports and goes on with its work (the
    recipe's under ``sailfin train``, torch's under ``sailfin launch``): the stop still
    ends the command there, in one line and 75, not a minute later."""
    (tmp_path / "swallowing.py").write_text(SWALLOWING_IMPORT)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG.replace("OUT", str(tmp_path / "out")).replace(
        "tests.recipes.LinearRecipe", "swallowing.Recipe"))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{tmp_path}", "OMP_NUM_THREADS": "1"}
    args = (["-m", "sailfin", "train", str(cfg)] if command == "train"
            else ["-c", LAUNCH_IMPORTING])
    proc = subprocess.Popen([sys.executable, *args], env=env, cwd=ROOT,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "importing").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=20)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert (proc.returncode, err.strip().splitlines()) == (75, [
        "sailfin: stopped by SIGTERM during set-up, before the first step; nothing was lost: "
        "run the same command again to start (or resume) (exit code 75)"
        if command == "train" else "sailfin launch: stopped by SIGTERM while starting, "
        "before any work began: nothing was lost; run the same command again (exit code 75)"])
    # At once, not when the thread that ends a set-up stuck in C gives up waiting.
    assert took < STUCK_SECONDS - 2, took


def console_script() -> str:
    """The ``sailfin`` script pip writes for pyproject.toml's entry point."""
    from tests.pyproject_toml import project

    entry = project()["scripts"]
    module, function = entry["sailfin"].split(":")
    return (f"import re\nimport sys\nfrom {module} import {function}\n"
            "if __name__ == '__main__':\n"
            "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
            f"    sys.exit({function}())\n")


# Every module imported while SIGTERM still has its default action (a bare -15) or SIGINT
# Python's (a KeyboardInterrupt traceback), written to IMPORTS_LOG.
AUDIT = '''
import os, signal, sys
_log = open(os.environ["IMPORTS_LOG"], "a")
def _hook(event, args):
    if event == "import" and (signal.getsignal(signal.SIGTERM) == signal.SIG_DFL or
                              signal.getsignal(signal.SIGINT) == signal.default_int_handler):
        _log.write(f"{args[0]}\\n")
        _log.flush()
sys.addaudithook(_hook)
'''


@pytest.mark.parametrize("how", ["console script", "python -m sailfin"])
def test_the_command_handles_a_stop_before_it_imports_anything_of_weight(tmp_path, how):
    """The console script imported sailfin.cli (yaml, argparse, the config schema: 0.2 to
    0.34 s on a loaded machine) before its first handler, and ``python -m sailfin`` the
    package (typing) before its: a signal there was a bare -15, a KeyboardInterrupt
    traceback, or a Ctrl-C an import swallowed while the run trained on."""
    (tmp_path / "sitecustomize.py").write_text(AUDIT)
    (tmp_path / "sailfin-script").write_text(console_script())
    log = tmp_path / "imports.log"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}", "IMPORTS_LOG": str(log)}
    start = ([str(tmp_path / "sailfin-script")] if how == "console script"
             else ["-m", "sailfin"])
    done = subprocess.run([sys.executable, *start, "--version"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("sailfin "), done
    imported = log.read_text().split()
    assert "sailfin" in imported, imported  # the audit hook saw the start
    before_handler = imported[imported.index("sailfin"):]
    # The package itself, the two stdlib modules its first lines need, and (for the
    # console script) the one-line version module and __main__ that sets the handler.
    allowed = {"sailfin", "signal", "sailfin.version", "sailfin.__main__"}
    if how == "python -m sailfin":
        allowed -= {"sailfin.version", "sailfin.__main__"}
    assert set(before_handler) <= allowed, before_handler


SWALLOWED_AT_START = """
import os, signal, sys, time
sys.argv[1:] = ["train", sys.argv[1]]
from sailfin.signals import stop_at_start
from sailfin.cli import command
stop_at_start()
try:  # code that swallows the stop (a bare except) while the command starts
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
except BaseException:
    pass
sys.exit(command())
"""


def test_a_stop_swallowed_while_the_command_starts_still_ends_it_before_any_step(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG.replace("OUT", str(tmp_path / "out")))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SWALLOWED_AT_START, str(cfg)], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr.strip().splitlines()) == (75, [
        "sailfin: stopped by SIGTERM during set-up, before the first step; nothing was lost: "
        "run the same command again to start (or resume) (exit code 75)"]), done
    assert not (tmp_path / "out").exists()  # it trained nothing
