"""Data files that are damaged, of another format, or of the wrong shape: each is one line
naming the file (and the row or line where known) and what to do, an HFConfigError from
the library and exit 2 from ``sailfin train``, never a traceback; nothing waits on a pipe."""

import json
import os
import threading
import time

import pytest

from sailfin.cli import main
from sailfin.hf import HFConfigError, TextData
from tests.hf.helpers import CONFIGS, VOCAB

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROWS = [{"text": f"def f{i}(x): return x + {i}", "label": "ab"[i % 2]} for i in range(6)]
ARROW = "data-00000-of-00001.arrow"


def parquet(tmp_path, rows=ROWS, schema=None):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def damaged_parquet(how):
    def make(tmp_path):
        path = parquet(tmp_path)
        size = path.stat().st_size
        path.write_bytes(path.read_bytes()[:size // 2] if how == "truncated" else b"\0" * size)
        return path, "is not a readable parquet file"
    return make


def not_parquet(tmp_path):
    path = tmp_path / "train.parquet"
    path.write_text("text,label\nhello,a\n")
    return path, "is not a readable parquet file"


def text_column(value, arrow_type, shown):
    def make(tmp_path):
        rows = [dict(r) for r in ROWS]
        rows[2]["text"] = value
        schema = pa.schema([("text", arrow_type), ("label", pa.string())])
        if arrow_type is not pa.string():  # the whole column of that type
            rows = [{**r, "text": value} for r in rows]
        return parquet(tmp_path, rows, schema), f"row {3 if arrow_type is pa.string() else 1}, " \
            f"column 'text' holds {shown}, not text (a string)"
    return make


def saved(tmp_path):
    """A save_to_disk directory as datasets writes it (state.json naming one Arrow stream)."""
    path = tmp_path / "saved"
    path.mkdir()
    table = pa.Table.from_pylist(ROWS)
    with pa.OSFile(str(path / ARROW), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    (path / "state.json").write_text(json.dumps({"_data_files": [{"filename": ARROW}]}))
    return path


def damaged_arrow(how):
    def make(tmp_path):
        path = saved(tmp_path)
        arrow = path / ARROW
        size = arrow.stat().st_size
        arrow.write_bytes(arrow.read_bytes()[:size // 2] if how == "truncated" else b"\0" * size)
        return path, f"{arrow} is not a readable Arrow stream"
    return make


def state_json(text, expected):
    def make(tmp_path):
        path = saved(tmp_path)
        (path / "state.json").write_text(text)
        return path, expected
    return make


def naming(filename, expected):
    def make(tmp_path):
        path = saved(tmp_path)
        if filename == "pipe.arrow":
            os.mkfifo(path / filename)
        (path / "state.json").write_text(json.dumps({"_data_files": [{"filename": filename}]}))
        return path, expected
    return make


def text_file(name, data):
    def make(tmp_path):
        path = tmp_path / name
        path.write_bytes(data)
        return path, None
    return make


def expect(make, expected):
    def wrapped(tmp_path):
        path, _ = make(tmp_path)
        return path, expected
    return wrapped


HEADER = b"text,label\n"
CASES = {
    "parquet truncated": damaged_parquet("truncated"),
    "parquet zeroed": damaged_parquet("zeroed"),
    "not parquet": not_parquet,
    "text int": text_column(7, pa.int64(), "an integer 7"),
    "text null": text_column(None, pa.string(), "null"),
    "text list": text_column(["a", "b"], pa.list_(pa.string()), "a list ['a', 'b']"),
    "text struct": text_column({"a": "b"}, pa.struct([("a", pa.string())]),
                               "a struct {'a': 'b'}"),
    "text binary": text_column(b"xy", pa.binary(), "binary b'xy'"),
    "arrow truncated": damaged_arrow("truncated"),
    "arrow zeroed": damaged_arrow("zeroed"),
    "state.json invalid": state_json("{not json", "state.json is not a JSON object"),
    "state.json a list": state_json("[1]", "state.json is not a JSON object"),
    "state.json no files": state_json("{}", "state.json lists no data files"),
    "state.json names a missing file": naming("gone.arrow", "names gone.arrow, which is "
                                                            "missing"),
    "state.json names ../": naming("../outside.arrow", "names '../outside.arrow', which is "
                                                       "not a file in"),
    "state.json names /dev/zero": naming("/dev/zero", "names '/dev/zero', which is not a "
                                                      "file in"),
    "state.json names a FIFO": naming("pipe.arrow", "names pipe.arrow, which is a FIFO "
                                                    "(named pipe), not a regular file"),
    "csv not UTF-8": expect(text_file("t.csv", HEADER + b"ok,a\ncaf\xe9,b\n"),
                            "t.csv line 3 is not UTF-8 text (byte 0xe9)"),
    "csv field over 131,072 characters": expect(
        text_file("t.csv", HEADER + b"ok,a\n" + b"x" * 131_073 + b",b\n"),
        "t.csv line 3 cannot be read as CSV (field larger than field limit (131072))"),
    "csv row with more fields": expect(text_file("t.csv", HEADER + b"ok,a\nx,b,extra\n"),
                                       "t.csv line 3 has 3 field(s), the header 2"),
    "csv row with fewer fields": expect(text_file("t.csv", HEADER + b"ok,a\nlonely\n"),
                                        "t.csv line 3 has 1 field(s), the header 2"),
    "jsonl not UTF-8": expect(text_file("t.jsonl", b'{"text": "ok", "label": "a"}\n'
                                                   b'{"text": "caf\xe9", "label": "b"}\n'),
                              "t.jsonl line 2 is not UTF-8 text (byte 0xe9)"),
    "jsonl array": expect(text_file("t.jsonl", b'{"text": "ok", "label": "a"}\n["x", "a"]\n'),
                          "t.jsonl line 2 is a JSON array, not an object"),
    "jsonl text a number": expect(text_file("t.jsonl", b'{"text": "ok", "label": "a"}\n'
                                                       b'{"text": 5, "label": "b"}\n'),
                                  "t.jsonl row 2, column 'text' holds an integer 5, not text"),
    "jsonl nested 50,000 deep": expect(
        text_file("t.jsonl", b'{"text": "ok", "label": "a"}\n{"text": '
                  + b"[" * 50_000 + b"]" * 50_000 + b', "label": "b"}\n'),
        "t.jsonl line 2 nests its values deeper than JSON lines of text do"),
    "jsonl label missing": expect(text_file("t.jsonl", b'{"text": "ok", "label": "a"}\n'
                                                       b'{"text": "no label"}\n'),
                                  "t.jsonl row 2, column 'label' holds no value, not a label"),
}


@pytest.fixture
def unblock_pipes(tmp_path):
    """Should a reader open a FIFO of the test's, a writer opens it after 20 s so the test
    fails (too slow, the wrong message) instead of hanging."""
    def open_them():
        for fifo in tmp_path.rglob("pipe.arrow"):
            os.close(os.open(fifo, os.O_RDWR))  # never blocks; ends a reader's wait
    timer = threading.Timer(20, open_them)
    timer.start()
    yield
    timer.cancel()


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_data_file_is_one_line_from_the_library_and_exit_2(case, data_dir, tmp_path,
                                                                  capsys, unblock_pipes):
    path, expected = CASES[case](tmp_path)
    tok = str(data_dir / f"tokenizer-{VOCAB}")
    start = time.monotonic()
    with pytest.raises(HFConfigError) as err:
        TextData(tok, str(path), task="classification")
    message = str(err.value)
    assert time.monotonic() - start < 15
    assert "\n" not in message and message.startswith("data.init_args.train_file: ")
    assert str(path.name) in message and expected in message, message
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "data": {"class_path": "sailfin.hf.TextData",
                 "init_args": {"tokenizer": tok, "train_file": str(path)}},
        "module": {"class_path": "sailfin.hf.SequenceClassification",
                   "init_args": {"config": CONFIGS["classification"]}},
        "trainer": {"epochs": 1, "max_steps": 1, "train_batch_size": 2,
                    "output_dir": str(tmp_path / "out"), "writers": ["jsonl"]}}))
    assert main(["train", str(config)]) == 2
    err_text = capsys.readouterr().err
    assert "Traceback" not in err_text
    assert err_text.strip().splitlines() == [f"sailfin: config error: {message}"]
