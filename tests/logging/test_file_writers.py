"""CSV, TensorBoard and MLflow writers: what they write, read back with each
format's own reader; and start-up failures that name writer, path and key."""

import csv
import errno
import math
import os
import sys

import pytest

from sailfin.logging import CsvWriter, WriterError, build_writers
from sailfin.logging import destination

EVENTS = [({"loss": 0.5, "lr": 0.1, "note": "text", "ok": True}, 10, 0, "train"),
          ({"loss": math.nan, "lr": 0.05}, 20, 0, "train"),
          ({"dataset": "test", "accuracy": 0.75}, 20, 0, "val")]


def log_all(writer):
    writer.log_hparams({"trainer.epochs": 3, "trainer.max_steps": None,
                        "trainer.writers": ["csv"], "module.init_args.lr": 0.1})
    for event in EVENTS:
        writer.log_metrics(*event)
    writer.log_run_totals({"goodput": 0.5, "replayed_seconds": 1.25}, 20, 1)  # the end
    writer.close()


def test_csv_long_rows(tmp_path):
    log_all(CsvWriter(tmp_path / "m.csv"))
    with open(tmp_path / "m.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["step"], r["split"], r["name"], r["value"]) for r in rows] == [
        ("10", "train", "loss", "0.5"), ("10", "train", "lr", "0.1"),
        ("20", "train", "loss", "nan"), ("20", "train", "lr", "0.05"),
        ("20", "val", "test/accuracy", "0.75")]
    # Appending (a resumed run) keeps a single header.
    w = CsvWriter(tmp_path / "m.csv")
    w.log_metrics({"loss": 0.25}, 30, 1, "train")
    w.close()
    assert (tmp_path / "m.csv").read_text().count("step,epoch,split,name,value") == 1


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_full_disk_fails_at_start_up(tmp_path):
    """/dev/full answers every write with ENOSPC, as a full disk does."""
    os.symlink("/dev/full", tmp_path / "metrics.csv")
    with pytest.raises(WriterError) as info:
        build_writers(["csv"], str(tmp_path))
    message = str(info.value)
    assert "the csv writer cannot write to" in message and "metrics.csv" in message
    assert "No space left on device" in message and "trainer.output_dir" in message


def test_full_disk_in_directory_probe(tmp_path, monkeypatch):
    """The probe syncs a small file: a full disk or quota fails there, before the run."""
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(destination.os, "fsync", full)
    with pytest.raises(WriterError, match=r"jsonl writer cannot write to .*out: No space "
                                          r"left on device.*trainer.output_dir"):
        build_writers(["jsonl"], str(tmp_path / "out"))
    assert os.listdir(tmp_path / "out") == []  # the probe file is removed


@pytest.mark.parametrize("name", ["jsonl", "csv", "tensorboard"])
def test_path_through_a_file_fails_at_start_up(tmp_path, name):
    (tmp_path / "file").write_text("")
    with pytest.raises(WriterError, match=f"the {name} writer cannot write to .*file.*"
                                          "is a file, not a directory; change trainer.output_dir"):
        build_writers([name], str(tmp_path / "file" / "run"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_directory_fails_at_start_up(tmp_path):
    os.chmod(tmp_path, 0o500)
    try:
        with pytest.raises(WriterError, match="jsonl writer .*Permission denied"):
            build_writers(["jsonl"], str(tmp_path / "run"))
    finally:
        os.chmod(tmp_path, 0o700)


def test_tensorboard_scalars_and_hparams_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (w,) = build_writers(["tensorboard"], str(tmp_path)).writers
    log_all(w)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    assert {"train/loss", "train/lr", "val/test/accuracy"} <= set(scalars)
    lr = acc.Scalars("train/lr")  # TensorBoard stores float32
    assert [e.step for e in lr] == [10, 20]
    assert [e.value for e in lr] == pytest.approx([0.1, 0.05])
    assert [(e.step, e.value) for e in acc.Scalars("val/test/accuracy")] == [(20, 0.75)]
    assert math.isnan(acc.Scalars("train/loss")[1].value)
    # The run's totals (the time account) as time/..., once, at the last step.
    assert [(e.step, e.value) for e in acc.Scalars("time/goodput")] == [(20, 0.5)]
    assert [(e.step, e.value) for e in acc.Scalars("time/replayed_seconds")] == [(20, 1.25)]
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = acc.PluginTagToContent("hparams")
    start = next(plugin_data_pb2.HParamsPluginData.FromString(c).session_start_info
                 for c in content.values()
                 if plugin_data_pb2.HParamsPluginData.FromString(c).HasField(
                     "session_start_info"))
    assert start.hparams["trainer.epochs"].number_value == 3
    assert start.hparams["trainer.max_steps"].string_value == "None"
    assert start.hparams["module.init_args.lr"].number_value == 0.1


def test_mlflow_params_and_metrics_read_back(tmp_path):
    from mlflow.tracking import MlflowClient

    (w,) = build_writers(["mlflow"], str(tmp_path), mlflow_experiment="exp").writers
    run_id = w.run_id
    log_all(w)
    assert w.tracking_uri == "sqlite:///" + str(tmp_path / "mlflow.db")
    client = MlflowClient(tracking_uri=w.tracking_uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == os.path.basename(tmp_path)
    assert client.get_experiment(run.info.experiment_id).name == "exp"
    assert run.data.params["trainer.epochs"] == "3"
    assert run.data.params["trainer.writers"] == "['csv']"
    history = client.get_metric_history(run_id, "train/lr")
    assert [(m.step, m.value) for m in history] == [(10, 0.1), (20, 0.05)]
    assert [(m.step, m.value) for m in client.get_metric_history(
        run_id, "val/test/accuracy")] == [(20, 0.75)]
    assert [(m.step, m.value) for m in client.get_metric_history(
        run_id, "time/goodput")] == [(20, 0.5)]
    assert not os.path.exists("mlruns")  # nothing lands in the working directory


def test_mlflow_bad_store_fails_at_start_up_and_closes_the_others(tmp_path):
    with pytest.raises(WriterError, match="the mlflow writer cannot start a run at "
                                          "bogus://nowhere.*trainer.mlflow_tracking_uri"):
        build_writers(["csv", "mlflow"], str(tmp_path), mlflow_tracking_uri="bogus://nowhere")
    # The csv writer built first was closed: its header reached the disk.
    assert (tmp_path / "metrics.csv").read_text().startswith("step,epoch,split,name,value")


@pytest.mark.parametrize("name, package, module", [
    ("tensorboard", "tensorboard", "sailfin.logging.tensorboard_writer"),
    ("mlflow", "mlflow", "sailfin.logging.mlflow_writer")])
def test_missing_extra_names_the_pip_extra(tmp_path, monkeypatch, name, package, module):
    for loaded in [m for m in sys.modules if m.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, loaded)
    monkeypatch.setitem(sys.modules, package, None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    with pytest.raises(ModuleNotFoundError, match=rf"the {name} writer needs the '{package}' "
                                                  rf"package: pip install 'sailfin\[{name}\]'"):
        build_writers([name], str(tmp_path))


def test_mlflow_store_failure_during_training_is_reported_and_the_run_marked(tmp_path):
    from mlflow.tracking import MlflowClient

    (w,) = build_writers(["mlflow"], str(tmp_path)).writers
    run_id = w.run_id

    def broken(*args, **kwargs):
        raise RuntimeError("database is locked")

    real = w._client.log_batch
    w._client.log_batch = broken  # the store starts failing mid-run
    w.log_metrics({"loss": 1.0}, 1, 0, "train")
    w.flush()  # queued; sent (and failing) in the background
    with pytest.raises(WriterError, match=r"mlflow writer could not log to sqlite:///.*"
                                          r"RuntimeError: database is locked"):
        w.close()
    w._client.log_batch = real
    assert not w._sender.is_alive()
    assert MlflowClient(tracking_uri=w.tracking_uri).get_run(run_id).info.status == "FAILED"
