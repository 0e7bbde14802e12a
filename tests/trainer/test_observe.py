"""What watches a run: the summary's best value and peak memory, hyper-parameters
handed to writers, rank 0 only, and the profiler."""

import json
import warnings

import pytest

from sailfin import Trainer
from sailfin.checkpoint import CheckpointError
from sailfin.config import ConfigError, TrainerArguments
from sailfin.distributed import DistEnv
from sailfin.logging import Writer
from sailfin.trainer.features.loop_features import build_observers
from tests.recipes import IdData, LinearRecipe, args


class Recorder(Writer):
    def __init__(self):
        self.hparams, self.events = None, []

    def log_hparams(self, hparams):
        self.hparams = dict(hparams)

    def log_metrics(self, metrics, step, epoch, split):
        self.events.append((split, step, dict(metrics)))


def run(tmp_path, **kw):
    rec = Recorder()
    summary = Trainer(LinearRecipe(IdData(40, 12)), args(tmp_path, epochs=4, **kw),
                      writers=[rec]).train()
    return summary, rec


def test_summary_reports_best_metric_and_step(tmp_path):
    summary, rec = run(tmp_path, checkpoint={"best_metric": "mse", "best_mode": "max"})
    vals = [(step, m["mse"]) for split, step, m in rec.events if split == "val"]
    step, value = max(vals, key=lambda sv: sv[1])
    assert summary["best"] == {"metric": "mse", "mode": "max", "value": value, "step": step}
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["best"] == summary["best"]
    assert {"global_step", "epoch", "samples_seen", "train_seconds", "samples_per_second",
            "world_size", "val"} <= set(saved)  # the keys the summary always had


def test_best_defaults_to_validation_loss_if_any(tmp_path):
    summary, _ = run(tmp_path)
    assert summary["best"] is None  # LinearRecipe reports mse and count, no "loss"


def test_best_metric_typo_is_an_error_with_a_suggestion(tmp_path):
    with pytest.raises(CheckpointError, match=r"trainer.checkpoint.best_metric 'mes' is not "
                                              r"among the validation metrics of this run "
                                              r"\(did you mean 'mse'\?\): val/count, val/mse"):
        run(tmp_path, checkpoint={"best_metric": "mes"})


def test_peak_memory(tmp_path):
    summary, _ = run(tmp_path)
    memory = summary["peak_memory"]
    assert 10 * 2**20 < memory["cpu_rss_bytes"] < 64 * 2**30
    assert memory["cuda_max_allocated_bytes"] is None  # a CPU run


def test_hparams_default_to_the_trainer_settings(tmp_path):
    _, rec = run(tmp_path)
    assert rec.hparams["trainer.epochs"] == 4 and rec.hparams["trainer.writers"] == ["jsonl"]
    rec = Recorder()
    # A directory of its own: in the first run's, this run would find it finished and open
    # no writer.
    Trainer(LinearRecipe(IdData(20, 0)), args(tmp_path / "second"), writers=[rec],
            hparams={"module": {"init_args": {"lr": 0.05}}}).train()
    assert rec.hparams == {"module.init_args.lr": 0.05}


def test_other_ranks_build_no_writers_and_no_progress(tmp_path):
    targs = TrainerArguments(output_dir=str(tmp_path / "out"), writers=["jsonl", "csv"],
                             progress="lines", profile_steps=[1, 2])
    obs = build_observers(targs, DistEnv(rank=1, world_size=2))
    assert obs.writers.writers == []
    assert [type(c).__name__ for c in obs.callbacks] == ["StepProfiler"]
    assert not (tmp_path / "out").exists()
    main = build_observers(targs, DistEnv(rank=0, world_size=2))
    try:
        assert [type(w).__name__ for w in main.writers.writers] == [
            "JsonlWriter", "CsvWriter", "Progress"]
    finally:
        main.writers.close()


@pytest.mark.parametrize("bad, message", [
    ({"profile_steps": [3, 2]}, "trainer.profile_steps must be .start, end. with 1 <= start"),
    ({"profile_steps": [0, 2]}, "trainer.profile_steps"),
    ({"writers": ["csv", "csv"]}, "lists a writer twice"),
    ({"progress_interval": 0}, "trainer.progress_interval must be > 0"),
])
def test_config_errors(bad, message):
    with pytest.raises(ConfigError, match=message):
        TrainerArguments(**bad)


def test_profile_steps_trace_and_top_operators(tmp_path, capsys):
    module = LinearRecipe(IdData(60, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the profiler's own notices
        Trainer(module, args(tmp_path, epochs=1, train_batch_size=10, micro_batch_size=5,
                             profile_steps=[2, 4], progress="none")).train()
    out = capsys.readouterr().out
    trace = tmp_path / "profile" / "trace_rank0.json"
    assert f"[profile] steps 2-4: trace {trace}" in out
    assert "top operators by self time" in out and "aten::" in out
    events = json.loads(trace.read_text())["traceEvents"]
    steps = sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
    assert len(steps) == 3  # one mark per optimizer step in the range
    assert any(e.get("name") == "aten::mse_loss" for e in events)
    table = (tmp_path / "profile" / "top_ops_rank0.txt").read_text()
    assert "Self CPU" in table and "aten::" in table


def test_profile_range_past_the_end_keeps_what_ran(tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(LinearRecipe(IdData(30, 0)), args(tmp_path, profile_steps=[2, 50],
                                                   progress="none")).train()
    assert "[profile] steps 2-3: trace" in capsys.readouterr().out
    assert (tmp_path / "profile" / "trace_rank0.json").stat().st_size > 0


def test_cli_reports_an_unwritable_destination_before_training(tmp_path, capsys):
    from sailfin.cli import main

    (tmp_path / "file").write_text("")
    config = tmp_path / "run.yaml"
    config.write_text(
        "data: {class_path: tests.recipes.IdData, init_args: {n_train: 20, n_val: 0}}\n"
        "module: {class_path: tests.recipes.LinearRecipe}\n"
        f"trainer: {{writers: [csv], output_dir: {tmp_path / 'file' / 'out'}}}\n")
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert (f"sailfin: sailfin (summary.json, final weights, checkpoints) cannot write to "
            f"{tmp_path / 'file' / 'out'}") in err
    assert "is a file, not a directory; change trainer.output_dir" in err
