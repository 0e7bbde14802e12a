"""The progress display: a bar in a terminal (a real pseudo-terminal), plain
lines in a pipe, and the summary at the end."""

import io
import json
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sailfin import Trainer
from sailfin.trainer.features.progress import Progress, resolve_mode, summary_text
from tests.recipes import IdData, LinearRecipe, args

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """
data: {class_path: tests.recipes.IdData, init_args: {n_train: 400, n_val: 20}}
module: {class_path: tests.recipes.LinearRecipe, init_args: {lr: 0.05}}
trainer: {epochs: 3, train_batch_size: 10, log_every_n_steps: 10, writers: [stdout, jsonl],
          output_dir: OUT, checkpoint: {best_metric: mse}, progress_interval: 0.001}
"""


def write_config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG.replace("OUT", str(tmp_path / "out")))
    return path


def sailfin_cmd(config):
    return [sys.executable, "-m", "sailfin", "train", str(config)]


def read_until_exit(fd, proc, timeout):
    """Everything the child writes to ``fd`` until it exits (or the timeout)."""
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    return out.decode("utf-8", "replace")


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
def test_bar_in_a_terminal(tmp_path):
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))
    env = {k: v for k, v in os.environ.items() if k != "TERM"}
    proc = subprocess.Popen(sailfin_cmd(write_config(tmp_path)), stdin=slave, stdout=slave,
                            stderr=slave, cwd=ROOT, env=env, start_new_session=True)
    os.close(slave)
    try:
        out = read_until_exit(master, proc, timeout=120)
        assert proc.wait(timeout=30) == 0, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=10)
        os.close(master)
    frames = out.split("\r")
    bars = [f for f in frames if re.match(r"epoch \d/3 +\d+%\|", f)]
    assert len(bars) >= 3, out  # redrawn in place, not one line per step
    final = [f for f in bars if "120/120" in f][-1]
    assert final.startswith("epoch 3/3 100%|")
    assert re.search(r"loss [\d.]+, lr [\d.e+-]+, [\d.]+k? samples/s \(avg [\d.]+k?\)", final)
    assert "[progress]" not in out  # no plain lines in a terminal
    # The stdout writer's lines are printed above the bar, whole, their epochs counted as
    # the bar counts them.
    assert "\r\n[val] epoch 3 step 120 | mse" in out.replace("\r\r", "\r") or re.search(
        r"\r *\r\[val\] epoch 3 step 120 \| mse [\d.]+ \| count 20\r\n", out), out
    assert re.search(r"summary: 120 steps, 1,200 samples in [\d.]+ s .* \| best mse [\d.]+ "
                     r"\(min\) at step \d+ \| peak memory [\d,]+ MiB RSS", out), out


def test_plain_lines_in_a_pipe(tmp_path):
    proc = subprocess.run(sailfin_cmd(write_config(tmp_path)), cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[progress]")]
    assert lines[0] == ("[progress] training 120 steps (3 epoch(s) of 40), global batch 10, "
                        "world size 1")
    steps = [int(re.match(r"\[progress\] step (\d+)/120", line).group(1)) for line in lines[1:]]
    assert len(steps) >= 3 and steps == sorted(steps) and steps[-1] == 120
    assert re.fullmatch(r"\[progress\] step 120/120 \(100%\) \| epoch 3/3 \| loss [\d.]+ \| "
                        r"lr [\d.e+-]+ \| [\d.]+k? samples/s \(avg [\d.]+k?\) "
                        r"(\| [\d.]+ [kMGT]?FLOP/s (\(MFU [\d.]+%\) )?)?\| elapsed "
                        r"0:00:\d\d \| ETA 0:00:00", lines[-1].replace(", ", " | ")), lines[-1]
    assert any(re.search(r"ETA 0:00:\d\d$", line) for line in lines[1:-1])
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary_text(summary) in proc.stdout


def test_lines_are_periodic_and_read_no_tensor(tmp_path):
    """Lines come from the logged values; between logs nothing is read from the model."""
    buf = io.StringIO()
    progress = Progress("lines", interval=1e-9, line_stream=buf)
    module = LinearRecipe(IdData(50, 10))
    Trainer(module, args(tmp_path, epochs=2, log_every_n_steps=5, progress="none"),
            callbacks=[progress]).train()
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("[progress] training 10 steps (2 epoch(s) of 5)")
    body = [line for line in lines if line.startswith("[progress] step")]
    assert [int(line.split()[2].split("/")[0]) for line in body][:10] == list(range(1, 11))
    assert "loss" not in body[0]  # step 1: nothing logged yet, nothing synced to show
    assert "loss" in body[4] and "lr 4.50e-02" in body[4]  # logged at step 5
    assert lines[-1].startswith("summary: 10 steps, 100 samples")


def test_bar_mode_on_a_terminal_like_stream(tmp_path):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    assert resolve_mode("auto", stream) == "bar"
    assert resolve_mode("auto", io.StringIO()) == "lines"
    progress = Progress("auto", bar_stream=stream, line_stream=io.StringIO())
    Trainer(LinearRecipe(IdData(50, 10)), args(tmp_path, epochs=2, log_every_n_steps=5,
                                               progress="none"), callbacks=[progress]).train()
    assert "\r" in stream.getvalue() and "10/10" in stream.getvalue()


def test_bar_without_tqdm_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    assert resolve_mode("auto", type("T", (), {"isatty": lambda self: True})()) == "lines"
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'sailfin\[progress\]'"):
        Progress("bar")


class Tty(io.StringIO):
    def isatty(self):
        return True


def bar_frames(tmp_path, monkeypatch, columns, name):
    """Every frame the bar drew on a terminal of ``columns`` columns."""
    monkeypatch.setenv("COLUMNS", str(columns))  # the stream has no terminal size of its own
    stream = Tty()
    progress = Progress("bar", bar_stream=stream, line_stream=io.StringIO())
    Trainer(LinearRecipe(IdData(400, 10)), args(tmp_path / name, epochs=2, log_every_n_steps=5,
                                                progress="none"),
            callbacks=[progress]).train()
    frames = [f.rstrip() for f in stream.getvalue().replace("\n", "\r").split("\r")]
    return [f for f in frames if f.startswith("epoch ")]


FIELD = (r"(loss [\d.]+|lr [\d.]+e[+-]\d+|[\d.]+k? samples/s( \(avg [\d.]+k?\))?|"
         r"[\d.]+ [kMGT]?FLOP/s)")
FRAME = re.compile(rf"epoch [12]/2 +\d+%\|[^|]*\| \d+/80 \[[\d:]+<[\d:?]+"
                   rf"(, {FIELD})*\]")


def test_the_bar_fits_the_terminal_dropping_values_never_cutting_one(tmp_path, monkeypatch):
    """At 100 columns the bar was one character wide and the line cut ('... 167 M'): each
    frame now fits, ends with its bracket, and holds whole values only (loss and
    samples/s first; the learning rate, FLOP/s and the average when there is room)."""
    shown = {}
    for columns in (80, 100):
        frames = bar_frames(tmp_path, monkeypatch, columns, str(columns))
        valued = [f for f in frames if "loss" in f]
        assert valued, frames
        for frame in frames:
            assert len(frame) <= columns and FRAME.fullmatch(frame), (columns, frame)
            assert len(frame.split("|")[1]) >= 10, frame  # the bar keeps its width
        assert all("samples/s" in f for f in valued)
        shown[columns] = len(re.findall(FIELD, valued[-1].split("[", 1)[1]))
    assert 2 <= shown[80] < shown[100], shown  # more values where there is room


def test_train_lines_number_epochs_as_the_bar_and_show_flops_as_it_does(tmp_path, capsys):
    """'[train] epoch 14' beside 'epoch 15/15', 'tflops 7.414e-05' beside '149 MFLOP/s'."""
    Trainer(LinearRecipe(IdData(40, 10)), args(tmp_path, epochs=2, log_every_n_steps=4,
                                               writers=["stdout"], progress="lines",
                                               progress_interval=1e-9)).train()
    out = capsys.readouterr().out.splitlines()
    train = [line for line in out if line.startswith("[train]")]
    progress = [line for line in out if line.startswith("[progress] step")]
    assert [line.split()[2] for line in train] == ["1", "2"]  # steps 4 and 8 of 2 epochs
    assert "epoch 2/2" in progress[-1]
    rate = re.search(r"\| [\d.]+ [kMGT]?FLOP/s( \||$)", train[-1])
    assert rate and "tflops" not in train[-1], train[-1]
    assert re.search(r", [\d.]+ [kMGT]?FLOP/s", progress[-1])


def test_the_bar_fits_its_values_again_only_when_something_changed(tmp_path, monkeypatch):
    """Fitting the values beside the bar lays the bar out with tqdm up to 7 times: done at
    every logged event it was the largest per-step cost of a small model's run in a
    terminal. Done again only when the width changes, the values' text grows past the last
    fit's, or REFIT_SECONDS pass: far fewer layouts than events, and every frame still fits."""
    import tqdm

    from sailfin.trainer.features import progress as progress_module

    fits = []
    layout = tqdm.tqdm.format_meter
    fitting = progress_module.BAR_FORMAT.replace("{bar}", "")

    def counted(*a, **kw):
        if kw.get("bar_format") == fitting:
            fits.append(1)
        return layout(*a, **kw)

    monkeypatch.setattr(tqdm.tqdm, "format_meter", staticmethod(counted))
    monkeypatch.setenv("COLUMNS", "100")
    stream = Tty()
    events = 100
    Trainer(LinearRecipe(IdData(10 * events, 0)),
            args(tmp_path, epochs=1, log_every_n_steps=1, progress="none"),
            callbacks=[Progress("bar", bar_stream=stream, line_stream=io.StringIO())]).train()
    frames = [f.rstrip() for f in stream.getvalue().replace("\n", "\r").split("\r")]
    assert any("loss" in f for f in frames)
    assert all(len(f) <= 100 for f in frames)
    assert 1 <= len(fits) <= events // 2, len(fits)  # each fit: up to 7 layouts


class SlowSteps(LinearRecipe):
    """Each step takes a few milliseconds: the run's time is its steps' time."""

    def train_step(self, global_step, batch, device):
        time.sleep(0.004)
        return super().train_step(global_step, batch, device)


@pytest.mark.parametrize("stop", [{"max_steps": 6}, {}], ids=["max_steps-in-an-epoch", "epochs"])
def test_the_last_line_gives_the_summarys_average_rate(tmp_path, stop):
    """A run stopped by max_steps inside an epoch printed 'avg 6.7' beside the summary's
    13.7 samples/s: the epoch's time was counted twice (once in train_seconds, once as
    the epoch still running)."""
    from sailfin.trainer.features.progress import human

    buf = io.StringIO()
    progress = Progress("lines", interval=3600, line_stream=buf)
    trainer = Trainer(SlowSteps(IdData(80, 10)),
                      args(tmp_path, epochs=2, progress="none", **stop), callbacks=[progress])
    summary = trainer.train()
    last = [line for line in buf.getvalue().splitlines() if line.startswith("[progress] step")]
    assert last and f"(avg {human(summary['samples_per_second'])})" in last[-1], \
        (last[-1], summary["samples_per_second"])


def test_every_line_and_log_counts_epochs_from_1_alike(tmp_path, capsys):
    """metrics.jsonl and the resume lines counted epochs from 0, the console from 1."""
    import csv

    Trainer(LinearRecipe(IdData(40, 10)),
            args(tmp_path, epochs=2, log_every_n_steps=2, writers=["stdout", "jsonl", "csv"],
                 progress="lines", progress_interval=1e-9)).train()
    out = capsys.readouterr().out.splitlines()
    console = [(int(line.split()[4]), int(line.split()[2])) for line in out
               if line.startswith(("[train]", "[val]"))]  # (step, epoch)
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(e["step"], e["epoch"]) for e in events] == console
    assert console == [(2, 1), (4, 1), (4, 1), (6, 2), (8, 2), (8, 2)]  # val after each epoch
    with open(tmp_path / "metrics.csv", newline="") as fh:
        rows = {(int(r["step"]), int(r["epoch"])) for r in csv.DictReader(fh)}
    assert rows == set(console)
    bar = [int(re.search(r"step (\d+)/8 .*\| epoch (\d)/2", line).group(2)) for line in out
           if line.startswith("[progress] step")]
    assert bar[:4] == [1, 1, 1, 1] and bar[-1] == 2
    assert json.loads((tmp_path / "summary.json").read_text())["epoch"] == 2
