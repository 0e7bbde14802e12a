"""sailfin evaluate / predict on one process: the metrics and rows of a hand-written pass
over the same weights, every sample once, nothing of the training run touched, and no
output file after a kill or an error."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from sailfin import ModuleInterface, Trainer
from sailfin.cli import main
from tests.after.recipe import reference

from tests.after.runs import CONFIG, ROOT, fresh, trained


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """One finished run (sp) that the tests read: they write only eval-*.json into it."""
    return trained(tmp_path_factory.mktemp("after") / "run")


def loaded(weights: Path):
    """The recipe with these weights, loaded by hand."""
    module, _ = fresh(weights.parent)
    module.load_state_dict(load_file(str(weights)))
    return module


def snapshot(out: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(out)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in out.rglob("*") if p.is_file() and not p.name.startswith("eval-")}


def test_evaluate_best_gives_a_hand_written_passs_metrics_and_touches_no_run_file(tmp_path, run):
    out = run
    before = snapshot(out)
    best = (out / "checkpoints" / "best").read_text().strip()
    module, args = fresh(out)
    with Trainer(module, args) as trainer:
        result = trainer.evaluate(checkpoint="best", split="val")
    assert result["checkpoint"] == str(out / "checkpoints" / best)
    # The best checkpoint's weights, by hand: the safetensors of a fresh load of that step.
    with Trainer(*fresh(out)) as other:
        other.evaluate(checkpoint=str(out / "checkpoints" / best), split="val", write=False)
        ref = reference(other.module, other.module.data.val)
    metrics = result["metrics"]
    assert result["samples"] == 37 and metrics["count"] == 37.0
    assert metrics["positions"] == sum(range(37))  # every sample once
    assert metrics["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert metrics["mean_loss"] == pytest.approx(ref["loss"], rel=1e-5)  # 0-d per sample
    assert metrics["accuracy"] == pytest.approx(ref["accuracy"])
    written = json.loads((out / "eval-val.json").read_text())
    assert written["metrics"] == metrics and written["split"] == "val"
    assert snapshot(out) == before  # no lock, metrics.jsonl or checkpoint touched


def test_evaluate_of_the_final_weights_on_the_test_split_counts_each_sample_once(tmp_path, run):
    out = run
    ref = reference(loaded(out / "final" / "model.safetensors"), fresh(out)[0].data.test)
    with Trainer(*fresh(out)) as trainer:
        result = trainer.evaluate(checkpoint=str(out), split="test")
    assert result["checkpoint"] == str(out / "final" / "model.safetensors")
    assert result["samples"] == 23 and result["metrics"]["positions"] == sum(range(23))
    assert result["metrics"]["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert (out / "eval-test.json").is_file()


def test_predict_writes_every_row_in_input_order_with_its_id(tmp_path, run):
    out = run
    ref = reference(loaded(out / "final" / "model.safetensors"), fresh(out)[0].data.val)
    with Trainer(*fresh(out)) as trainer:
        result = trainer.predict(str(tmp_path / "p.jsonl"), checkpoint=str(out / "final"))
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert result["rows"] == len(rows) == 37
    assert [r["id"] for r in rows] == [r["position"] for r in rows] == list(range(37))
    assert [r["label"] for r in rows] == ref["labels"]
    assert [r["text"] for r in rows] == [f"s{i}" for i in range(37)]
    for row, logits in zip(rows, ref["logits"]):
        assert row["logits"] == pytest.approx(logits, rel=1e-5, abs=1e-6)


def test_predict_to_parquet(tmp_path, run):
    pq = pytest.importorskip("pyarrow.parquet")
    out = run
    with Trainer(*fresh(out)) as trainer:
        trainer.predict(str(tmp_path / "p.parquet"), checkpoint="latest", split="test")
    table = pq.read_table(tmp_path / "p.parquet").to_pylist()
    assert [r["id"] for r in table] == [r["position"] for r in table] == list(range(23))


def test_a_predict_step_that_fails_leaves_no_output_file(tmp_path, run):
    out = run
    target = tmp_path / "p.jsonl"
    module, args = fresh(out, "--module.init_args.fail_predict_at", "20")
    with Trainer(module, args) as trainer, pytest.raises(RuntimeError, match="sample 20"):
        trainer.predict(str(target), checkpoint="latest")
    assert os.listdir(tmp_path) == []  # neither the output nor its partial file


def test_a_kill_during_predict_leaves_no_file_under_the_outputs_name(tmp_path, run):
    out = run
    target = tmp_path / "p.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sailfin", "predict", CONFIG, "--checkpoint", "latest",
         "--out", str(target), "--trainer.output_dir", str(out),
         "--module.init_args.slow_predict", "0.5"], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        partial = []
        while time.monotonic() < deadline and proc.poll() is None:
            partial = [p for p in tmp_path.iterdir() if p.name.startswith(".p.jsonl.tmp-")]
            if partial and partial[0].stat().st_size > 0:
                break
            time.sleep(0.05)
        assert partial and proc.poll() is None, proc.communicate()[0].decode()[-2000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not target.exists()  # rows were written, but only under the partial name


def test_the_commands_print_and_write(tmp_path, capsys, run):
    out = run
    common = [CONFIG, "--checkpoint", "best", "--trainer.output_dir", str(out)]
    assert main(["evaluate", *common, "--split", "val", "test"]) == 0
    printed = capsys.readouterr().out
    assert "evaluate val (37 samples" in printed and "evaluate test (23 samples" in printed
    assert json.loads((out / "eval-test.json").read_text())["samples"] == 23
    assert main(["predict", *common, "--split", "test", "--out", str(tmp_path / "t.jsonl")]) == 0
    assert "predict test: 23 rows" in capsys.readouterr().out
    assert main(["evaluate", *common[:1], "--checkpoint", str(tmp_path / "nope"),
                 "--trainer.output_dir", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_trainer_set_up_to_evaluate_refuses_to_train(tmp_path, run):
    out = run
    with Trainer(*fresh(out)) as trainer:
        trainer.evaluate(checkpoint="latest", write=False)
        with pytest.raises(RuntimeError, match="build a new Trainer"):
            trainer.train()


def test_a_recipe_without_predict_step_predicts_val_steps_per_sample_values(tmp_path, run):
    from tests.after.recipe import PositionClassifier

    out = run
    module, args = fresh(out)
    # The same recipe without a predict_step of its own.
    module.__class__ = type("NoPredict", (PositionClassifier,),
                            {"predict_step": ModuleInterface.predict_step})
    with Trainer(module, args) as trainer:
        trainer.predict(str(tmp_path / "v.jsonl"), checkpoint=str(out), split="test")
    rows = [json.loads(line) for line in (tmp_path / "v.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [int(r["position"]) for r in rows] == list(range(23))
    assert set(rows[0]) == {"id", "loss", "pred", "label", "position"}  # mean_loss: 0-d
