import io
import json
import math

import pytest

from sailfin.logging import (JsonlWriter, StdoutWriter, Writer, WriterError, Writers,
                             build_writers)


def test_stdout_line_format():
    buf = io.StringIO()
    StdoutWriter(buf).log_metrics({"loss": 0.12345, "lr": 1e-5, "samples_per_second": 12345.6,
                                   "n": 3}, step=20, epoch=2, split="train")
    # Epochs as the trainer passes them, counted from 1 (the bar's "epoch 2/..."); FLOP/s and MFU as
    # the progress bar shows them, not "tflops 7.414e-05".
    assert buf.getvalue() == ("[train] epoch 2 step 20 | loss 0.1235 | lr 1.000e-05 | "
                              "samples_per_second 12345.6 | n 3\n")
    buf = io.StringIO()
    StdoutWriter(buf).log_metrics({"loss": 0.5, "tflops": 7.414e-05, "mfu": 0.0123},
                                  step=345, epoch=15, split="train")
    assert buf.getvalue() == "[train] epoch 15 step 345 | loss 0.5000 | 74.1 MFLOP/s | MFU 1.2%\n"


def test_jsonl_records_and_non_finite_values(tmp_path):
    w = JsonlWriter(tmp_path / "sub" / "metrics.jsonl")
    w.log_metrics({"loss": math.nan, "acc": 0.5}, step=3, epoch=0, split="val")
    w.close()
    rec = json.loads((tmp_path / "sub" / "metrics.jsonl").read_text())
    assert rec == {"step": 3, "epoch": 0, "split": "val", "loss": None, "acc": 0.5}


def test_jsonl_bad_path_fails_at_construction(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(WriterError, match="the jsonl writer cannot write to .*/f: .*/f is a "
                                          "file, not a directory; change trainer.output_dir"):
        JsonlWriter(tmp_path / "f" / "metrics.jsonl")


def test_writers_forward_to_each(tmp_path):
    calls = []

    class Rec(Writer):
        def log_metrics(self, metrics, step, epoch, split):
            calls.append((dict(metrics), step))

        def close(self):
            calls.append("closed")

    ws = Writers([Rec(), Rec()])
    ws.log_metrics({"a": 1.0}, 5, 0, "train")
    ws.close()
    assert calls == [({"a": 1.0}, 5), ({"a": 1.0}, 5), "closed", "closed"]


def test_build_writers(tmp_path):
    ws = build_writers(["stdout", "jsonl"], str(tmp_path))
    assert [type(w) for w in ws.writers] == [StdoutWriter, JsonlWriter]
    ws.close()
