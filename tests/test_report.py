"""`sailfin report`: charts rendered from metrics.jsonl, checked as images."""

import json
import time

import numpy as np
import pytest

from sailfin import Trainer
from sailfin.cli import main
from sailfin.report import ReportError, load_run, render
from tests.recipes import IdData, LinearRecipe, args

ORANGE = np.array([1.0, 127 / 255, 14 / 255])  # matplotlib's C1: the second run's colour


def train(path, lr):
    Trainer(LinearRecipe(IdData(60, 12), lr=lr),
            args(path, epochs=4, log_every_n_steps=2, progress="none")).train()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    a, b = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
    train(a, 0.05)
    train(b, 0.01)
    return a, b


def image(path):
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(str(path))[..., :3]
    height, width = pixels.shape[:2]
    assert 200 <= height <= 2000 and 300 <= width <= 2000, (height, width)
    return pixels


def inked(pixels):
    """Fraction of pixels that are not (near) white."""
    return float((pixels.min(axis=2) < 0.9).mean())


def orange(pixels):
    return int((np.abs(pixels - ORANGE).max(axis=2) < 0.08).sum())


def test_charts_of_one_run(runs):
    a, _ = runs
    written = render([str(a)], dpi=80)
    names = sorted(p.rsplit("/", 1)[1] for p in written)
    assert names == ["goodput.png", "loss.png", "lr.png", "overview.png", "report.md",
                     "tflops.png", "throughput.png", "val_count.png", "val_mse.png"]
    for name in [n for n in names if n.endswith(".png")]:
        pixels = image(a / "report" / name)
        assert 0.01 < inked(pixels) < 0.6, name  # drawn on, not blank, not a solid block
        assert pixels.std() > 0.05
        assert orange(pixels) == 0 or name == "goodput.png"  # one run: one colour
    md = (a / "report" / "report.md").read_text()
    summary = json.loads((a / "summary.json").read_text())
    assert f"| {a.name} | {summary['global_step']} | {summary['samples_seen']} |" in md
    assert "![loss](loss.png)" in md and "![overview](overview.png)" in md
    from sailfin.logging.stdout import flop_rate

    assert "| FLOP/s per device (MFU) |" in md and f"| {flop_rate(summary['tflops'])} |" in md


def test_compare_overlays_runs(runs, tmp_path):
    a, b = runs
    render([str(a)], str(tmp_path / "one"), dpi=80)
    render([str(a), str(b)], str(tmp_path / "two"), dpi=80)
    one, two = image(tmp_path / "one" / "loss.png"), image(tmp_path / "two" / "loss.png")
    assert orange(one) == 0 and orange(two) > 50  # the second run is drawn in its colour
    md = (tmp_path / "two" / "report.md").read_text()
    assert f"| {a.name} |" in md and f"| {b.name} |" in md


def test_cli(runs, tmp_path, capsys):
    a, b = runs
    assert main(["report", str(a), "--compare", str(b), "--out", str(tmp_path / "r")]) == 0
    assert "report: 9 files in" in capsys.readouterr().out
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err


def test_restarted_run_and_torn_last_line(tmp_path):
    lines = [{"step": s, "epoch": 0, "split": "train", "loss": 1.0 / s} for s in (2, 4, 6)]
    lines += [{"step": s, "epoch": 0, "split": "train", "loss": 2.0} for s in (4, 6, 8)]
    text = "".join(json.dumps(x) + "\n" for x in lines) + '{"step": 10, "spl'
    (tmp_path / "metrics.jsonl").write_text(text)
    run = load_run(str(tmp_path))
    assert run.train["loss"] == ([2, 4, 6, 8], [0.5, 2.0, 2.0, 2.0])  # resumed from step 4


def test_corrupt_line_names_file_and_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "split": "train", "loss": 1}\n'
                                            'garbage\n{"step": 2, "split": "train"}\n')
    with pytest.raises(ReportError, match=r"metrics.jsonl:2 is not a sailfin metrics record"):
        load_run(str(tmp_path))


def test_several_validation_sets_get_a_chart_each(tmp_path):
    events = [{"step": 5, "epoch": 0, "split": "train", "loss": 1.0},
              {"step": 5, "epoch": 0, "split": "val", "dataset": "dev", "acc": 0.5},
              {"step": 5, "epoch": 0, "split": "val", "dataset": "test", "acc": 0.4},
              {"step": 9, "epoch": 1, "split": "val", "dataset": "dev", "acc": 0.7}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    written = render([str(tmp_path)], dpi=60)
    assert {p.rsplit("/", 1)[1] for p in written} >= {"val_dev_acc.png", "val_test_acc.png"}
    assert load_run(str(tmp_path)).val["dev/acc"] == ([5, 9], [0.5, 0.7])
    assert "dev/acc 0.7, test/acc 0.4" in (tmp_path / "report" / "report.md").read_text()


GREEN, RED = np.array([44, 160, 44]) / 255, np.array([214, 39, 40]) / 255  # productive, replayed


def colored(pixels, color):
    return int((np.abs(pixels - color).max(axis=2) < 0.05).sum())


class Crash(Exception):
    pass


def test_goodput_chart_of_a_run_that_crashed_and_resumed(tmp_path):
    """One bar per start, coloured by component: the crashed start's lost steps in red."""
    from sailfin import Callback

    class CrashAt(Callback):
        def on_step_end(self, trainer):
            if trainer.global_step in (7, 8):  # the steps lost: long enough to draw at any
                time.sleep(0.1)                # load (a few ms each drew no red pixel once)
            if trainer.global_step == 8:
                raise Crash()

    kw = dict(epochs=2, checkpoint={"every_n_steps": 4}, progress="none")
    with pytest.raises(Crash):
        Trainer(LinearRecipe(IdData(60, 12)), args(tmp_path, **kw),
                callbacks=[CrashAt()]).train()
    Trainer(LinearRecipe(IdData(60, 12)), args(tmp_path, **kw)).train()
    written = render([str(tmp_path)], dpi=80)
    assert str(tmp_path / "report" / "goodput.png") in written
    pixels = image(tmp_path / "report" / "goodput.png")
    assert colored(pixels, GREEN) > 50 and colored(pixels, RED) > 0
    account = json.loads((tmp_path / "time_account.json").read_text())
    assert [s["from_step"] for s in account["segments"]] == [0, 6]  # the epoch-end save
    assert account["segments"][0]["seconds"]["replayed"] > 0  # steps 7-8, logged then lost
    md = (tmp_path / "report" / "report.md").read_text()
    assert "goodput" in md and "1 restart(s) after a failure" in md
    assert "![goodput](goodput.png)" in md


def spiky_run(path):
    """The digits report's shape: ~1,000 samples/s, ~74 MFLOP/s, one 40,603 samples/s
    window (and its FLOP/s with it)."""
    rng = np.random.default_rng(0)
    lines = []
    for step in range(5, 305, 5):
        rate = 40603.0 if step == 150 else 1000.0 + 80 * rng.standard_normal()
        lines.append({"step": step, "epoch": 0, "split": "train", "loss": 1.0 / step,
                      "samples_per_second": rate, "tflops": rate * 7.4e-8})
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return load_run(str(path))


def test_a_spike_does_not_flatten_a_rate_chart_and_is_marked(tmp_path):
    from matplotlib.figure import Figure

    from sailfin.report import _plot, charts, spike_limit

    run = spiky_run(tmp_path)
    specs = {stem: spec for stem, *spec in charts([run])}
    ax = Figure().subplots()
    _plot(ax, [run], *specs["throughput"])
    normal = [v for v in run.train["samples_per_second"][1] if v < 10_000]
    bottom, top = ax.get_ylim()
    assert max(normal) < top < 1.2 * max(normal)  # the axis is the other windows'
    assert [t.get_text() for t in ax.texts] == ["40,603 (off the axis)"]  # marked
    assert spike_limit(normal) is None  # no spike: the axis as matplotlib draws it
    # FLOP/s read in the unit that fits them: 74 MFLOP/s, not 0.00007 TFLOP/s.
    ax = Figure().subplots()
    _plot(ax, [run], *specs["tflops"])
    assert ax.get_ylabel() == "MFLOP/s" and ax.get_title() == "Model FLOP/s per device"
    assert 60 < ax.get_ylim()[1] < 120
    written = render([str(tmp_path)], dpi=80)
    assert str(tmp_path / "report" / "throughput.png") in written
