"""Seq2SeqLM: encoder-decoder models (BART, T5) trained on text -> target, scored by ROUGE."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .metrics import perplexity
from .module import HFModule
from .rouge import rouge
from .text_data import TextData


class Seq2SeqLM(HFModule):
    """``AutoModelForSeq2SeqLM`` on ``text_column`` -> ``target_column``. Validation
    reports the target ``loss``/``perplexity`` and, generating with ``num_beams`` and
    ``max_new_tokens``, ROUGE-1/2/L F1 against the targets.

    Example::

        data = TextData("tok", "train.jsonl", "val.jsonl", target_column="summary")
        module = Seq2SeqLM(data, config={"model_type": "bart", "d_model": 32,
            "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 2,
            "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
            "max_position_embeddings": 256}, num_beams=2, max_new_tokens=16)
    """

    task = "seq2seq"
    auto_class = "AutoModelForSeq2SeqLM"
    shift_labels = False

    def __init__(self, data: TextData, num_beams: int = 1, max_new_tokens: int = 32,
                 generate: bool = True, **kwargs: Any) -> None:
        super().__init__(data, **kwargs)
        self.num_beams, self.max_new_tokens, self.generate = num_beams, max_new_tokens, generate

    def val_step(self, global_step: int, batch: dict[str, torch.Tensor], device: torch.device
                 ) -> dict[str, Any]:
        out = self.forward_batch(batch, device)
        labels = batch["labels"].to(device)
        nll = torch.nn.functional.cross_entropy(out.logits.float().transpose(1, 2), labels,
                                                ignore_index=-100, reduction="none")
        result: dict[str, Any] = {"nll": nll.sum(1), "tokens": (labels != -100).sum(1)}
        if self.generate:
            generated = self.model.generate(
                input_ids=batch["input_ids"].to(device),
                attention_mask=batch["attention_mask"].to(device),
                num_beams=self.num_beams, max_new_tokens=self.max_new_tokens)
            refs = batch["labels"].masked_fill(batch["labels"] == -100,
                                               self.tokenizer.pad_token_id)
            decode = self.tokenizer.batch_decode
            result["prediction"] = decode(generated.cpu(), skip_special_tokens=True)
            result["reference"] = decode(refs, skip_special_tokens=True)
        return result

    def on_end_val_epoch(self, global_step: int, outputs: dict[str, Any], key: str = "val"
                         ) -> Optional[dict[str, float]]:
        metrics = perplexity(outputs["nll"], outputs["tokens"])
        if self.generate:
            metrics.update(rouge(outputs["prediction"], outputs["reference"]))
        return metrics
