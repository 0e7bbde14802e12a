"""evaluate and predict a sailfin.hf recipe trained with LoRA: the best checkpoint gives
the metrics training logged for it; final/hf (a PEFT adapter directory) the trained
model's; predict's default rows are the trained model's classes, in order."""

from __future__ import annotations

import json

import pytest
import torch

from sailfin import Trainer, seed_everything
from tests.hf.helpers import args, module, train

pytest.importorskip("peft")

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0}
BEST = {"best_metric": "accuracy", "best_mode": "max", "at_epoch_end": False}


def fresh(data_dir, out):
    seed_everything(0)  # the base the run started from (built from a config block)
    return Trainer(module("classification", data_dir, peft=LORA), args(out))


def test_lora_best_and_final_hf_evaluate_and_predict(data_dir, tmp_path):
    out = tmp_path / "run"
    m, _, summary = train("classification", data_dir, out, module_kw={"peft": LORA},
                          max_steps=6, val_every_n_steps=2, checkpoint=BEST)
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = {e["step"]: e for e in events if e.get("split") == "val" or "accuracy" in e}
    best = int((out / "checkpoints" / "best").read_text().strip().split("-")[1])
    with fresh(data_dir, out) as trainer:
        result = trainer.evaluate(checkpoint="best")
    assert result["samples"] == len(m.data.datasets["val"])
    for key in ("loss", "accuracy", "f1_macro"):
        assert result["metrics"][key] == pytest.approx(logged[best][key], rel=1e-5), key
    with fresh(data_dir, out) as trainer:
        final = trainer.evaluate(checkpoint=str(out / "final" / "hf"), write=False)
        trainer.predict(str(tmp_path / "p.jsonl"))
    for key in ("loss", "accuracy"):
        assert final["metrics"][key] == pytest.approx(summary["val"][key], rel=1e-5), key
    # By hand: the trained module in memory over the whole validation set.
    rows_in = [m.data.datasets["val"][i] for i in range(len(m.data.datasets["val"]))]
    batch = m.data.collate(rows_in)
    m.eval()
    with torch.no_grad():
        probs = m.model(**{k: v for k, v in batch.items() if k != "labels"}).logits.softmax(-1)
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == list(range(len(rows_in)))
    assert [r["label"] for r in rows] == [m.label_names[i] for i in probs.argmax(-1).tolist()]
    assert [r["score"] for r in rows] == pytest.approx(probs.max(-1).values.tolist(), rel=1e-4)


@pytest.mark.parametrize("task", ["token_classification", "causal_lm", "seq2seq"])
def test_each_tasks_default_predict_step_gives_one_row_per_sample(task, data_dir, tmp_path):
    seed_everything(0)
    extra = {"max_new_tokens": 3} if task == "seq2seq" else {}
    m = module(task, data_dir, **extra)
    m.max_new_tokens = 3
    batch = m.data.collate([m.data.datasets["val"][i] for i in range(3)])
    m.eval()
    with torch.no_grad():
        out = m.predict_step(0, batch, torch.device("cpu"))
    (key,) = out
    assert len(out[key]) == 3
    if task == "token_classification":
        words = (batch["labels"] != -100).sum(1).tolist()
        assert [len(tags) for tags in out["tags"]] == words
        assert all(t in m.label_names for tags in out["tags"] for t in tags)
    else:
        assert all(isinstance(text, str) for text in out["generated"])


def test_a_save_pretrained_directory_evaluates_as_the_trained_model(data_dir, tmp_path):
    out = tmp_path / "run"
    _, _, summary = train("classification", data_dir, out, max_steps=2)
    seed_everything(1)  # another start: the directory's weights replace every one of them
    with Trainer(module("classification", data_dir), args(out)) as trainer:
        result = trainer.evaluate(checkpoint=str(out / "final" / "hf"), write=False)
    for key in ("loss", "accuracy"):
        assert result["metrics"][key] == pytest.approx(summary["val"][key], rel=1e-5), key
