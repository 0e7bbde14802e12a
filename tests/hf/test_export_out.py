"""``sailfin export SOURCE OUT`` never deletes what it did not write, never hangs on a
special file, and says what was wrong in one line; it follows ``checkpoints/best`` and
``checkpoints/latest`` and takes a run's output directory as its final model.

It once removed the run it exported from (OUT = the run: checkpoints/, final/ and the
metrics gone, exit 0), a user's directory (notes.txt gone), blocked for good on a FIFO
as OUT, ended in a traceback for OUT a file, a link or ``.``, and told a user to delete
``checkpoints/best``."""

import hashlib
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from sailfin.cli import main
from tests.hf.helpers import NO_DROPOUT, write, yaml_config

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(data_dir, tmp_path_factory):
    """A finished sailfin.hf run: a checkpoint each step, ``best`` not the last one."""
    tmp = tmp_path_factory.mktemp("export-run")
    out = tmp / "run"
    cfg = yaml.safe_load(yaml_config("classification", data_dir, out, max_steps=3,
                                     val_every_n_steps=1, val_every_n_epochs=0,
                                     checkpoint={"every_n_steps": 1, "best_metric": "loss",
                                                 "best_mode": "max"}))
    cfg["module"]["init_args"]["config"].update(NO_DROPOUT["classification"])
    assert main(["train", write(tmp / "c.yaml", yaml.safe_dump(cfg))]) == 0
    return out


def tree(path: Path) -> dict:
    """Every entry under ``path``: its kind and, for a file, its bytes' digest."""
    found = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            full = Path(root) / name
            found[str(full.relative_to(path))] = (
                hashlib.sha256(full.read_bytes()).hexdigest() if full.is_file() else "dir")
    return found


def refused(capsys, argv, *words):
    capsys.readouterr()  # what came before
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sailfin: export: "), err
    for word in words:
        assert word in err[0], err[0]
    return err[0]


def test_an_export_into_the_run_or_its_checkpoint_is_refused_and_changes_nothing(
        run, tmp_path, capsys):
    before = tree(run)
    step = sorted((run / "checkpoints").glob("step-*"))[0]
    for out in (run, run / "checkpoints", step, step / "sub", run / "final" / "hf",
                run / "exported", run.parent):
        refused(capsys, ["export", str(step), str(out)], f"OUT {out}")
        assert tree(run) == before, out
    refused(capsys, ["export", str(run / "checkpoints"), str(run / "checkpoints")],
            "inside the checkpoint or the run")
    refused(capsys, ["export", str(run), str(run / "final")], "inside the run")
    assert tree(run) == before
    assert not list(run.parent.glob("*.tmp-*")) and not list(run.glob("*.tmp-*"))


def test_an_existing_directory_that_no_export_wrote_is_refused_and_kept(run, tmp_path,
                                                                        capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    refused(capsys, ["export", str(run / "checkpoints"), str(mine)], "notes.txt",
            "move it away")
    assert (mine / "notes.txt").read_text() == "keep me"
    # The advice: moved away, the export goes ahead.
    mine.rename(tmp_path / "mine-kept")
    assert main(["export", str(run / "checkpoints"), str(mine)]) == 0
    assert (tmp_path / "mine-kept" / "notes.txt").read_text() == "keep me"
    # An earlier export is replaced; once a user adds a file to it, it is theirs.
    assert main(["export", str(run / "checkpoints" / "best"), str(mine)]) == 0
    (mine / "notes.txt").write_text("mine")
    refused(capsys, ["export", str(run / "checkpoints"), str(mine)], "notes.txt")
    assert (mine / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("kind, words", [
    ("file", "is a file"), ("link to a directory", "is a symbolic link"),
    ("dangling link", "is a symbolic link"), ("character device", "is a character device"),
    ("working directory", "is the working directory"),
])
def test_an_out_that_is_not_a_directory_to_write_is_one_line(run, tmp_path, capsys,
                                                             monkeypatch, kind, words):
    out = tmp_path / "out"
    if kind == "file":
        out.write_text("data")
    elif kind == "link to a directory":
        (tmp_path / "target").mkdir()
        out.symlink_to(tmp_path / "target")
    elif kind == "dangling link":
        out.symlink_to(tmp_path / "nowhere")
    elif kind == "character device":
        try:  # /dev/null's numbers, here: an export that replaced OUT would not touch /dev
            os.mknod(out, stat.S_IFCHR | 0o600, os.makedev(1, 3))
        except PermissionError:  # not root: and then /dev cannot be written either
            out = Path("/dev/null")
    else:
        monkeypatch.chdir(tmp_path)
        out = Path(".")
    refused(capsys, ["export", str(run / "checkpoints"), str(out)], words)
    if kind == "file":
        assert out.read_text() == "data"
    if kind == "dangling link":
        assert not (tmp_path / "nowhere").exists() and out.is_symlink()


def test_a_fifo_as_out_is_refused_at_once(run, tmp_path):
    """It blocked in rmtree (opening the FIFO) until killed."""
    os.mkfifo(tmp_path / "fifo")
    os.mkfifo(tmp_path / "out.tmp-999999999")  # a stale sibling the export removes
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "sailfin", "export", str(run / "checkpoints"),
                           str(tmp_path / "fifo")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"sailfin: export: OUT {tmp_path / 'fifo'} exists and is a FIFO; an export writes a "
        "new directory (or replaces an earlier export): give another name, or move it "
        "away"], done.stderr
    done = subprocess.run([sys.executable, "-m", "sailfin", "export", str(run / "checkpoints"),
                           str(tmp_path / "out")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "out.tmp-999999999").exists()


def weights(path: Path) -> dict:
    return load_file(str(path / "model.safetensors"))


def same(a: Path, b: Path) -> bool:
    x, y = weights(a), weights(b)
    return x.keys() == y.keys() and all((x[k] == y[k]).all() for k in x)


def test_best_and_latest_are_followed_and_a_run_gives_its_final_model(run, tmp_path):
    checkpoints = run / "checkpoints"
    best = (checkpoints / "best").read_text().strip()
    latest = (checkpoints / "latest").read_text().strip()
    assert best != latest
    for name in ("best", "latest"):
        assert main(["export", str(checkpoints / name), str(tmp_path / name)]) == 0
    assert main(["export", str(checkpoints / best), str(tmp_path / "step-best")]) == 0
    assert main(["export", str(checkpoints / latest), str(tmp_path / "step-latest")]) == 0
    assert same(tmp_path / "best", tmp_path / "step-best")
    assert same(tmp_path / "latest", tmp_path / "step-latest")
    assert not same(tmp_path / "best", tmp_path / "latest")
    # The run's output directory: its final model, final/hf, file for file.
    assert main(["export", str(run), str(tmp_path / "final")]) == 0
    for name in os.listdir(run / "final" / "hf"):
        assert (tmp_path / "final" / name).read_bytes() == \
            (run / "final" / "hf" / name).read_bytes(), name
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "final")
    assert model.config.model_type == "bert"


def test_a_pointer_or_run_without_a_model_says_what_to_export_and_that_works(
        run, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(run / "checkpoints", copy / "checkpoints")  # a run without final/
    (copy / "checkpoints" / "best").write_text("step-99999999\n")  # names no checkpoint
    said = refused(capsys, ["export", str(copy), str(tmp_path / "a")],
                   "without a final model")
    advice = said.split("sailfin export ", 1)[1].split()
    assert advice == [str(copy / "checkpoints"), "OUT"]
    assert main(["export", advice[0], str(tmp_path / "a")]) == 0
    said = refused(capsys, ["export", str(copy / "checkpoints" / "best"), str(tmp_path / "b")],
                   "names no complete checkpoint")
    advice = said.split("sailfin export ", 1)[1].split()
    assert advice == [str(copy / "checkpoints"), "OUT"]
    assert main(["export", advice[0], str(tmp_path / "b")]) == 0
    assert same(tmp_path / "a", tmp_path / "b")
