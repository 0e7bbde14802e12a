"""metrics.jsonl after a resume reads as one run."""

import json

from sailfin.logging.metrics_log import trim_metrics_log


def write(path, events, tail=""):
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + tail)


EVENTS = [{"step": 1, "split": "train", "loss": 1.0},
          {"step": 2, "split": "train", "loss": 0.9},
          {"step": 2, "split": "val", "mse": 0.5},
          {"step": 3, "split": "train", "loss": 0.8},
          {"step": 4, "split": "train", "loss": 0.7}]


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_drops_events_past_the_step_and_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write(path, EVENTS, tail='{"step": 5, "split": "tra')
    assert trim_metrics_log(str(path), 2, validated=True) == 3
    assert read(path) == EVENTS[:3]
    assert path.read_text().endswith("\n")


def test_validation_at_the_step_goes_when_the_checkpoint_preceded_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write(path, EVENTS)
    assert trim_metrics_log(str(path), 2, validated=False) == 3
    assert read(path) == EVENTS[:2]


def test_nothing_to_drop_leaves_the_file_alone(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write(path, EVENTS)
    before = path.stat().st_mtime_ns
    assert trim_metrics_log(str(path), 9, validated=True) == 0
    assert path.stat().st_mtime_ns == before and read(path) == EVENTS


def test_missing_file_and_unreadable_lines(tmp_path):
    assert trim_metrics_log(str(tmp_path / "none.jsonl"), 3, validated=True) == 0
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(EVENTS[0]) + "\n" + "garbage\n" + json.dumps(EVENTS[1]) + "\n")
    assert trim_metrics_log(str(path), 3, validated=True) == 1
    assert read(path) == EVENTS[:2]
