"""Tiny models (2 layers, hidden 32) of each family on standard-library functions."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from sailfin import Trainer, TrainerArguments, seed_everything  # noqa: E402
from sailfin.hf.examples_data import StdlibTextData  # noqa: E402

PER_PACKAGE = 12
VOCAB = 400
CONFIGS = {
    "classification": {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "intermediate_size": 64,
                       "max_position_embeddings": 64},
    "token_classification": {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2,
                             "num_attention_heads": 2, "intermediate_size": 64,
                             "max_position_embeddings": 64},
    "causal_lm": {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2,
                  "n_positions": 64},
    "seq2seq": {"model_type": "bart", "d_model": 32, "encoder_layers": 2, "decoder_layers": 2,
                "encoder_attention_heads": 2, "decoder_attention_heads": 2,
                "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "max_position_embeddings": 64},
}
MODULES = {"classification": "SequenceClassification",
           "token_classification": "TokenClassification", "causal_lm": "CausalLM",
           "seq2seq": "Seq2SeqLM"}


def data(task: str, data_dir: Path, **kw) -> StdlibTextData:
    return StdlibTextData(task, str(data_dir), per_package=PER_PACKAGE, vocab_size=VOCAB,
                          max_length=kw.pop("max_length", 64), **kw)


NO_DROPOUT = {"classification": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
              "causal_lm": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}}


def module(task: str, data_dir: Path, data_kw: dict | None = None,
           config_kw: dict | None = None, **kw):
    import sailfin.hf as hf

    cls = getattr(hf, MODULES[task])
    extra = {"max_new_tokens": 4} if task == "seq2seq" else {}
    return cls(data(task, data_dir, **(data_kw or {})), config={**CONFIGS[task], **(config_kw or {})},
               lr=3e-3, warmup_steps=2, weight_decay=0.01, **{**extra, **kw})


def args(out: Path, **kw) -> TrainerArguments:
    base = dict(epochs=1, max_steps=4, train_batch_size=8, micro_batch_size=4, seed=0,
                output_dir=str(out), writers=["jsonl"], log_every_n_steps=1,
                val_batch_size=16)
    base.update(kw)
    return TrainerArguments(**base)


def train(task: str, data_dir: Path, out: Path, callbacks=(), module_kw=None, **kw):
    seed_everything(kw.get("seed", 0))  # the same initial weights, as `sailfin train` builds
    m = module(task, data_dir, **(module_kw or {}))
    trainer = Trainer(m, args(out, **kw), callbacks=callbacks)
    return m, trainer, trainer.train()


def yaml_config(task: str, data_dir: Path, out: Path, **trainer) -> str:
    import yaml

    init = {"task": task, "out_dir": str(data_dir), "per_package": PER_PACKAGE,
            "vocab_size": VOCAB, "max_length": 64}
    module_args = {"config": CONFIGS[task], "lr": 3e-3}
    cfg = {"data": {"class_path": "sailfin.hf.examples_data.StdlibTextData", "init_args": init},
           "module": {"class_path": f"sailfin.hf.{MODULES[task]}", "init_args": module_args},
           "trainer": {"epochs": 1, "max_steps": 4, "train_batch_size": 8,
                       "micro_batch_size": 4, "seed": 0, "output_dir": str(out),
                       "writers": ["jsonl"], "log_every_n_steps": 1, **trainer}}
    return yaml.safe_dump(cfg)


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return os.fspath(path)
