"""Checkpoint files and entries that are not what they claim: none hangs, escapes or
crashes a resume.

Each damage is done to the newest checkpoint (step 6); ``resume: auto`` must fall back
to step 4 with one line naming the file, and the same checkpoint named as
``trainer.resume`` must fail with that line (a :class:`CheckpointCorrupt`).
"""

import json
import os
import re
import shutil
import signal
import socket
import zlib

import pytest
import torch

from sailfin import Trainer
from sailfin.checkpoint import CheckpointCorrupt
from sailfin.checkpoint.manifest import MAX_DEPTH as MANIFEST_MAX_DEPTH
from sailfin.checkpoint.manifest import seal
from tests.checkpoint.forge import (NEEDS, forge_metadata, forge_shard_entry, forge_trainer_entry,
                                   refile, rewrite_shards)
from tests.checkpoint.helpers import Crash, CrashAt
from tests.recipes import IdData, LinearRecipe, args

STEP = {"every_n_steps": 2, "at_epoch_end": False, "keep_last": None}
SHARD = "shards/__0_0.distcp"  # the model, optimizers and small state, written with DCP
INDEX = "shards/.metadata"  # DCP's index of them


def train(tmp, callbacks=(), **kw):
    module = LinearRecipe(IdData(40, 6), dropout=0.2, momentum=0.9)
    trainer = Trainer(module, args(tmp, **kw), callbacks=list(callbacks))
    try:
        trainer.train()
    except Crash:
        pass
    return module, trainer


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A run stopped after step 7: checkpoints at steps 2, 4 and 6."""
    out = tmp_path_factory.mktemp("pristine")
    train(out, callbacks=[CrashAt(7)], epochs=2, checkpoint=STEP)
    return out


@pytest.fixture
def run_dir(pristine, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(pristine, out, symlinks=True)
    return out


@pytest.fixture(autouse=True)
def no_hang():
    """A read that blocks (a FIFO opened for reading) fails the test instead of hanging it."""
    def on_alarm(signum, frame):
        raise TimeoutError("reading the checkpoint hung")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def manifest_of(step_dir):
    return json.loads((step_dir / "manifest.json").read_text())


def write_manifest(step_dir, body):
    """``body`` as the manifest, its own checksum recomputed (as whoever forges one can)."""
    (step_dir / "manifest.json").write_bytes(seal(body))


def fifo(path):
    path.unlink()
    os.mkfifo(path)
    return path


def dev_zero(path):
    path.unlink()
    path.symlink_to("/dev/zero")
    return path


def escaping_entry(step):
    """The manifest lists ../../outside.distcp: a perfect copy of the shard, outside the run."""
    outside = step.parent.parent.parent / "outside.distcp"
    shutil.copy(step / SHARD, outside)
    body = manifest_of(step)
    files = body["sharded"]["files"]
    files["../../../../outside.distcp"] = files.pop("__0_0.distcp")
    write_manifest(step, body)
    return step / "shards", "'../../../../outside.distcp', not a file name"


def escaping_link(step):
    """The model's shard is a link to a perfect copy of itself outside the checkpoint."""
    outside = step.parent.parent.parent / "outside.distcp"
    shutil.copy(step / SHARD, outside)
    (step / SHARD).unlink()
    (step / SHARD).symlink_to(outside)
    return step / SHARD, "outside the checkpoint directory"


def no_files(step):
    body = manifest_of(step)
    body["sharded"]["files"] = {}
    write_manifest(step, body)
    return step / "shards", "lists no .metadata"


def no_shards(step):
    body = manifest_of(step)
    del body["sharded"]
    write_manifest(step, body)
    return step / "manifest.json", "lacks sharded"


def deep_json(step):
    (step / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    return step / "manifest.json", f"nests deeper than {MANIFEST_MAX_DEPTH} levels"


def huge_manifest(step):
    with open(step / "manifest.json", "r+b") as fh:
        fh.truncate(17 << 20)  # sparse: costs no disk
    return step / "manifest.json", "more than the 16777216 such a file can hold"


def list_in_trainer(step):
    """The trainer's entry rewritten as a list, its checksums fixed in the manifest."""
    return rewrite_shards(step, lambda state: state.update(trainer=[1, 2, 3])), \
        "(entry 'trainer') holds a list, not the trainer's state"


def flipped_entry_bit(step):
    """One bit of the trainer's entry flipped, the shard file's CRC-32 fixed to match: the
    entry's own CRC-32 (checked by the rank that reads it) finds it."""
    body = manifest_of(step)
    entry = body["sharded"]["entries"]["trainer"]["size"]
    data = bytearray((step / SHARD).read_bytes())
    at = data.find(b"counters")  # inside the trainer's pickle
    assert at > 0 and entry > 0
    data[at] ^= 0x01
    (step / SHARD).write_bytes(bytes(data))
    refile(step, SHARD)
    return step / SHARD, "(entry 'trainer') does not match its CRC-32 in the manifest"


def flipped_shard_bit(step):
    """One bit of the model's shard flipped: its CRC-32 in the manifest no longer fits."""
    data = bytearray((step / SHARD).read_bytes())
    data[len(data) // 2] ^= 0x01
    (step / SHARD).write_bytes(bytes(data))
    return step / SHARD, "does not match its crc32 in the manifest"


def absurd_step(step):
    body = manifest_of(step)
    body["step"] = 10 ** 12
    write_manifest(step, body)
    return step / "manifest.json", "says step 1000000000000, but checkpoint entry"


def index_is_a_directory(step):
    (step / INDEX).unlink()
    (step / INDEX).mkdir()
    return step / INDEX, "is a directory, not a regular file"


def unix_socket(path):
    """``path`` replaced by a Unix socket (bound from its directory: socket paths are short)."""
    path.unlink()
    here = os.getcwd()
    os.chdir(path.parent)
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(path.name)
    finally:
        os.chdir(here)
    return path


def link_loop(path):
    """``path`` a symbolic link to a link back to it."""
    path.unlink()
    other = path.with_name(path.name + ".loop")
    path.symlink_to(other.name)
    other.symlink_to(path.name)
    return path


def no_manifest(step):
    (step / "manifest.json").unlink()
    return step, "has no manifest.json"


def flipped_manifest_bit(step):
    """One bit of the manifest's data.global_batch flipped: still valid JSON, a config that
    looks changed, but the manifest's own checksum says it is damage."""
    text = (step / "manifest.json").read_text()
    at = re.search(r'"global_batch": \d+', text).end() - 1  # its last digit: 10 -> 11
    text = text[:at] + chr(ord(text[at]) ^ 0x01) + text[at + 1:]
    (step / "manifest.json").write_text(text)
    return step / "manifest.json", "does not match its own CRC-32"


def marker_of(step):
    return step.parent.parent.parent / "marker"  # created if a forged pickle ran


FORGERIES = {
    "shards/.metadata forged": lambda s: (forge_metadata(s, marker_of(s)),
                                          f"names {NEEDS}, which DCP's metadata never holds"),
    "the trainer's entry forged": lambda s: (forge_trainer_entry(s, marker_of(s)),
                                             f"(it needs {NEEDS})"),
    "a shard's small entry forged": lambda s: (forge_shard_entry(s, marker_of(s)),
                                               f"(it needs {NEEDS})"),
}

DAMAGES = {
    **FORGERIES,
    "model shard a Unix socket": lambda s: (unix_socket(s / SHARD), "it is a socket"),
    "manifest.json a Unix socket": lambda s: (unix_socket(s / "manifest.json"),
                                              "it is a socket"),
    "shard index a Unix socket": lambda s: (unix_socket(s / INDEX), "it is a socket"),
    "model shard a link loop": lambda s: (link_loop(s / SHARD), "a loop of symbolic links"),
    "manifest.json a link loop": lambda s: (link_loop(s / "manifest.json"),
                                            "a loop of symbolic links"),
    "shard index a link loop": lambda s: (link_loop(s / INDEX), "a loop of symbolic links"),
    "manifest.json missing": no_manifest,
    "manifest a bit flipped": flipped_manifest_bit,
    "model shard a FIFO": lambda s: (fifo(s / SHARD), "is a FIFO (named pipe)"),
    "model shard a link to /dev/zero": lambda s: (dev_zero(s / SHARD),
                                                   "is a character device"),
    "model shard a bit flipped": flipped_shard_bit,
    "trainer's entry a bit flipped, the file's CRC-32 fixed": flipped_entry_bit,
    "manifest.json a FIFO": lambda s: (fifo(s / "manifest.json"), "is a FIFO (named pipe)"),
    "shard index a link to /dev/zero": lambda s: (dev_zero(s / INDEX),
                                                  "is a character device"),
    "manifest entry ../../../../outside.distcp": escaping_entry,
    "model shard a link out of the checkpoint": escaping_link,
    "manifest shard files {}": no_files,
    "manifest without shards": no_shards,
    "manifest 200,000 levels deep": deep_json,
    "manifest of 17 MB": huge_manifest,
    "the trainer's entry holds a list": list_in_trainer,
    "manifest step 10**12": absurd_step,
    "shard index a directory": index_is_a_directory,
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_auto_falls_back_with_one_line_naming_the_file(run_dir, damage, capfd):
    file, said = DAMAGES[damage](run_dir / "checkpoints" / "step-00000006")
    capfd.readouterr()
    _, trainer = train(run_dir, epochs=2, checkpoint=STEP)
    err = capfd.readouterr().err
    assert trainer.resumed_from.name == "step-00000004"
    line = next(line for line in err.splitlines() if line.startswith("sailfin: resume: "))
    assert str(file) in line and said in line, line
    assert "skipped damaged checkpoint(s) step-00000006; falling back to" in err
    assert "Traceback" not in err
    assert not (run_dir.parent / "marker").exists()


@pytest.mark.parametrize("damage", DAMAGES)
def test_an_explicit_path_fails_with_one_line_naming_the_file(run_dir, tmp_path, damage):
    step = run_dir / "checkpoints" / "step-00000006"
    file, said = DAMAGES[damage](step)
    with pytest.raises(CheckpointCorrupt) as caught:
        train(tmp_path / "other", epochs=2, resume=str(step))
    message = str(caught.value)
    assert str(file) in message and said in message and "\n" not in message, message
    assert not marker_of(step).exists()


def test_nothing_outside_the_checkpoint_is_read(run_dir, monkeypatch):
    """The escaping entry is refused before anything is opened (not after a checksum)."""
    escaping_entry(run_dir / "checkpoints" / "step-00000006")
    opened = []
    real_open = os.open

    def spy(path, *a, **kw):
        opened.append(os.path.realpath(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr(os, "open", spy)
    train(run_dir, epochs=2, checkpoint=STEP)
    outside = str(run_dir.parent.parent / "outside.distcp")
    assert outside not in opened and any(p.endswith(".metadata") for p in opened)


@pytest.mark.parametrize("mode", ["auto", "explicit"])
def test_latest_a_directory_is_ignored_and_replaced(run_dir, tmp_path, mode, capfd):
    root = run_dir / "checkpoints"
    (root / "latest").unlink()
    (root / "latest").mkdir()
    resume = "auto" if mode == "auto" else str(root / "step-00000006")
    _, trainer = train(run_dir, epochs=2, checkpoint=STEP, resume=resume)
    assert os.path.basename(trainer.resumed_from.name) == "step-00000006"
    assert (root / "latest").is_file()  # the next saves moved the pointer again
    assert (root / "latest").read_text().strip() == "step-00000008"
    assert f"removed {root / 'latest'}: it was not the pointer file" in capfd.readouterr().err


def test_latest_a_directory_with_files_stops_before_the_first_step(run_dir):
    from sailfin.checkpoint import CheckpointError

    root = run_dir / "checkpoints"
    (root / "latest").unlink()
    (root / "latest").mkdir()
    (root / "latest" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=f"{root / 'latest'} is a directory with files"):
        train(run_dir, epochs=2, checkpoint=STEP)
    assert (root / "latest" / "notes.txt").read_text() == "mine"


def test_the_cli_says_one_line_and_exits_2(tmp_path, capfd):
    from sailfin.cli import main

    out = tmp_path / "out"
    config = tmp_path / "run.yaml"
    config.write_text(f"""
data: {{class_path: tests.recipes.IdData, init_args: {{n_train: 20, n_val: 0}}}}
module: {{class_path: tests.recipes.LinearRecipe}}
trainer: {{train_batch_size: 10, writers: [jsonl], output_dir: {out},
           checkpoint: {{every_n_steps: 1}}}}
""")
    assert main(["train", str(config)]) == 0
    step = out / "checkpoints" / "step-00000002"
    fifo(step / SHARD)
    capfd.readouterr()
    assert main(["train", str(config), "--trainer.resume", str(step),
                 "--trainer.output_dir", str(tmp_path / "again")]) == 2
    err = capfd.readouterr().err
    assert err == (f"sailfin: checkpoint error: checkpoint shard {step / SHARD} is a FIFO "
                   "(named pipe), not a regular file: the checkpoint is damaged or was tampered "
                   "with\n")


def test_a_step_entry_linked_to_a_directory_outside_is_not_resumed(run_dir, tmp_path, capfd):
    """step-00000008 a link to a complete checkpoint of another run: never resumed."""
    other = tmp_path / "other"
    shutil.copytree(run_dir / "checkpoints" / "step-00000006", other)
    body = manifest_of(other)
    body["step"] = 8
    write_manifest(other, body)
    link = run_dir / "checkpoints" / "step-00000008"
    link.symlink_to(other, target_is_directory=True)
    capfd.readouterr()
    _, trainer = train(run_dir, epochs=2, checkpoint=STEP)
    assert trainer.resumed_from.name == "step-00000006"
    err = capfd.readouterr().err
    assert err.count(f"checkpoint {link} is a symbolic link (to {other})") == 1
    assert other.is_dir()  # what it points at is left alone


def test_a_large_file_is_announced_before_it_is_read(run_dir, monkeypatch, capfd):
    """A file far larger than the state it should hold (sparse here, the manifest edited to
    match it, its CRC recomputed) is not read in silence: a line names it and its size."""
    from sailfin.checkpoint import serialize

    step = run_dir / "checkpoints" / "step-00000006"
    with open(step / SHARD, "r+b") as fh:
        fh.truncate(0)
        fh.truncate(8 << 20)  # sparse: costs no disk
    refile(step, SHARD)
    monkeypatch.setattr(serialize, "SAY_ABOVE_BYTES", 4 << 20)
    capfd.readouterr()
    _, trainer = train(run_dir, epochs=2, checkpoint=STEP)
    err = capfd.readouterr().err
    assert f"checking checkpoint shard {step / SHARD} (8 MiB) against its checksum" in err
    assert trainer.resumed_from.name == "step-00000004"  # then refused as damaged
