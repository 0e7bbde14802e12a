"""Hugging Face ``transformers`` models as sailfin recipes, configured from YAML (docs/hf.md).

``pip install 'sailfin[hf]'``. Importing this package imports ``transformers`` only
when a name is first used.

Example::

    data = TextData("my-model", "train.jsonl", "val.jsonl", max_length=128)
    module = SequenceClassification(data, model_name_or_path="my-model", num_labels=2)
    sailfin.Trainer(module, args).train()      # -> outputs/final/hf/
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "TextData": "sailfin.hf.text_data",
    "TokenizeText": "sailfin.hf.tokenizers",
    "SequenceClassification": "sailfin.hf.tasks",
    "TokenClassification": "sailfin.hf.tasks",
    "CausalLM": "sailfin.hf.tasks",
    "Seq2SeqLM": "sailfin.hf.tasks",
    "HFModule": "sailfin.hf.module",
    "SavePretrained": "sailfin.hf.export",
    "HFConfigError": "sailfin.hf.errors",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sailfin.hf' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted(__all__)
