"""Each family trains a few steps on sp; final/hf/ loads without sailfin, same logits."""

import json

import pytest
import torch

from tests.hf.helpers import MODULES, train

transformers = pytest.importorskip("transformers")

AUTO = {"classification": "AutoModelForSequenceClassification",
        "token_classification": "AutoModelForTokenClassification",
        "causal_lm": "AutoModelForCausalLM", "seq2seq": "AutoModelForSeq2SeqLM"}
METRICS = {"classification": {"accuracy", "f1", "f1_macro", "loss"},
           "token_classification": {"entity_f1", "entity_precision", "entity_recall",
                                    "token_accuracy"},
           "causal_lm": {"loss", "perplexity"},
           "seq2seq": {"loss", "perplexity", "rouge1", "rouge2", "rougeL"}}


@pytest.mark.parametrize("task", list(MODULES))
def test_trains_and_final_hf_loads_with_the_same_logits(task, data_dir, tmp_path):
    m, trainer, summary = train(task, data_dir, tmp_path, val_every_n_epochs=1)
    assert summary["global_step"] == 4
    assert set(summary["val"]) == METRICS[task]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").open()
              if '"train"' in line and '"loss"' in line]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert summary["flops_per_sample"] == pytest.approx(m.flops_per_sample())

    # final/hf/ is a save_pretrained directory: config, safetensors weights, tokenizer.
    hf_dir = tmp_path / "final" / "hf"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in hf_dir.iterdir()}
    loaded = getattr(transformers, AUTO[task]).from_pretrained(hf_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert len(tok) == len(m.tokenizer)
    batch = m.data.collate([m.data.datasets["val"][i] for i in range(3)])
    m.eval()
    with torch.no_grad():
        ours = m.model(**batch).logits
        theirs = loaded(**batch).logits
    assert torch.equal(ours, theirs)
    if task in ("classification", "token_classification"):
        assert loaded.config.id2label == dict(enumerate(m.label_names))


@pytest.mark.parametrize("task", ["causal_lm", "token_classification"])
def test_per_token_losses_do_not_depend_on_the_micro_batch(task, data_dir, tmp_path):
    """loss_per: sample (the default) is exact under accumulation; the model's own
    micro-batch token mean (loss_per: token) is not."""
    from tests.hf.helpers import NO_DROPOUT

    off = {"config_kw": NO_DROPOUT.get(task, NO_DROPOUT["classification"])}
    runs = {}
    for name, micro, loss_per in (("big", 8, "sample"), ("small", 2, "sample"),
                                  ("token", 2, "token")):
        m, _, _ = train(task, data_dir, tmp_path / name, max_steps=2, micro_batch_size=micro,
                        module_kw={**off, "loss_per": loss_per})
        runs[name] = m.model.state_dict()
    for k, value in runs["big"].items():
        torch.testing.assert_close(runs["small"][k], value, rtol=1e-5, atol=1e-6)
    key = next(k for k in runs["big"] if k.endswith("weight") and "emb" not in k)
    assert not torch.allclose(runs["token"][key], runs["big"][key], rtol=1e-5, atol=1e-6)


def test_adamw_is_the_fused_kernel_on_plain_cpu_parameters(data_dir, tmp_path):
    from sailfin.hf.module import fusable

    m, trainer, summary = train("classification", data_dir, tmp_path)
    (opt,) = trainer.optimizers
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"] is True
    assert not fusable([torch.zeros(2, dtype=torch.int64)]) and not fusable([])
