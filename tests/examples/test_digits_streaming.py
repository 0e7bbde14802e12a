"""The digits example streamed from shards: local directory and HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import os
import re

import pytest
import sklearn  # noqa: F401  (sets KMP_* variables on import: before the environment check)
import torch

from examples.digits.streaming import TRAIN_SHARDS, VAL_SHARDS, main
from sailfin.cli import main as sailfin_main


def accuracy(capsys):
    out = capsys.readouterr().out
    return float(re.search(r"validation accuracy: ([0-9.]+)", out).group(1)), out


@pytest.fixture()
def one_thread():
    # A tiny MLP gains nothing from intra-op threads, and on a shared machine they
    # make each step wait for a busy core.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_digits_stream_from_local_shards_and_over_http(tmp_path, capsys, one_thread):
    shards = str(tmp_path / "shards")
    # HTTP: the example writes the shards (a DataProcessor, 2 processes), serves them on
    # 127.0.0.1, trains from the URLs, and stops the server.
    assert main(["--http", "--shards", shards, "--output-dir", str(tmp_path / "http"),
                 "--trainer.writers", "[jsonl]"]) == 0
    http_accuracy, out = accuracy(capsys)
    base = re.search(r"serving .* at (http://127\.0\.0\.1:\d+)", out).group(1)
    cached = os.listdir(tmp_path / "http" / "shard-cache")
    assert len([n for n in cached if n.endswith(".tar")]) == 15 + 4
    # Local: the config as shipped, pointed at the same shards.
    assert sailfin_main(["train", "examples/digits/config_streaming.yaml",
                         f"--data.init_args.write_to={shards}",
                         f"--data.init_args.train_urls={shards}/{TRAIN_SHARDS}",
                         f"--data.init_args.val_urls={shards}/{VAL_SHARDS}",
                         f"--trainer.output_dir={tmp_path / 'local'}",
                         "--trainer.writers", "[jsonl]"]) == 0
    local_accuracy, _ = accuracy(capsys)
    # The map-style demo reaches >= 0.95 (tests/test_cli.py); so does streaming, and
    # both sources give the very same run.
    assert local_accuracy >= 0.95
    assert http_accuracy == local_accuracy
    summary = json.loads((tmp_path / "local" / "summary.json").read_text())
    assert summary["samples_seen"] == 15 * 1438
    # The server is gone: nothing listens on its port any more.
    import urllib.error
    import urllib.request
    try:
        urllib.request.urlopen(base + "/train/shard-000000.tar.idx", timeout=2)
        raise AssertionError("the example's HTTP server is still running")
    except (urllib.error.URLError, ConnectionError):
        pass
