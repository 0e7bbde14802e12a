"""The tasks: sequence classification, token classification, causal LM, seq2seq LM."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .errors import HFConfigError
from .metrics import accuracy, entity_f1, f1_scores, perplexity, rouge
from .module import HFModule, token_nll
from .predict import classification_rows, generated_rows, token_rows
from .text_data import TextData


class _Labelled(HFModule):
    """A task whose labels come from the data (classes, or token tags)."""

    def __init__(self, data: TextData, num_labels: Optional[int] = None, **kwargs: Any) -> None:
        data.prepare(self.task)
        if num_labels is not None and num_labels != len(data.labels):
            raise HFConfigError(
                f"module.init_args.num_labels is {num_labels}, but the data has "
                f"{len(data.labels)} labels ({', '.join(data.labels[:8])}"
                f"{', ...' if len(data.labels) > 8 else ''}); set num_labels "
                f"{len(data.labels)} or list them in data.init_args.labels")
        self.label_names = list(data.labels)
        super().__init__(data, **kwargs)

    def model_kwargs(self) -> dict[str, Any]:
        names = self.label_names
        return {"num_labels": len(names), "id2label": dict(enumerate(names)),
                "label2id": {n: i for i, n in enumerate(names)}}


class SequenceClassification(_Labelled):
    """``AutoModelForSequenceClassification`` on text (and text pair) with a label per row.
    Reports ``loss``, ``accuracy``, ``f1`` (binary F1 of the second label with two
    labels, else macro) and ``f1_macro``.

    Example::

        module = SequenceClassification(TextData("tok", "train.jsonl", "val.jsonl"),
                                        model_name_or_path="my-bert", lr=1e-3)
    """

    task = "classification"
    auto_class = "AutoModelForSequenceClassification"

    def val_step(self, global_step: int, batch: dict[str, torch.Tensor], device: torch.device
                 ) -> dict[str, torch.Tensor]:
        out = self.forward_batch(batch, device)
        labels = batch["labels"].to(device)
        loss = torch.nn.functional.cross_entropy(out.logits.float(), labels, reduction="none")
        return {"pred": out.logits.argmax(-1), "label": labels, "loss": loss}

    def on_end_val_epoch(self, global_step: int, outputs: dict[str, Any], key: str = "val"
                         ) -> dict[str, float]:
        pred, label = outputs["pred"], outputs["label"]
        return {"loss": outputs["loss"].mean().item(), "accuracy": accuracy(pred, label),
                **f1_scores(pred, label, len(self.label_names))}

    def predict_step(self, global_step: int, batch: dict[str, torch.Tensor],
                     device: torch.device) -> dict[str, Any]:
        """Each row's class name (``label``) and its probability (``score``)."""
        return classification_rows(self, batch, device)


class TokenClassification(_Labelled):
    """``AutoModelForTokenClassification`` on words and their tags (a list each per row;
    a word's first sub-word carries its tag). Reports ``entity_f1`` (spans, as
    seqeval), ``entity_precision``, ``entity_recall``, ``token_accuracy``.

    Example::

        data = TextData("tok", "train.jsonl", text_column="words", label_column="tags")
        module = TokenClassification(data, model_name_or_path="my-bert")
    """

    task = "token_classification"
    auto_class = "AutoModelForTokenClassification"
    shift_labels = False

    def val_step(self, global_step: int, batch: dict[str, torch.Tensor], device: torch.device
                 ) -> dict[str, Any]:
        out = self.forward_batch(batch, device)
        pred = out.logits.argmax(-1).cpu()
        labels = batch["labels"]
        names = self.label_names
        keep = labels != -100
        # Per sample, a list of tag names: lengths differ, so lists (gathered as objects).
        return {"pred_tags": [[names[t] for t in p[k].tolist()] for p, k in zip(pred, keep)],
                "gold_tags": [[names[t] for t in g[k].tolist()] for g, k in zip(labels, keep)]}

    def on_end_val_epoch(self, global_step: int, outputs: dict[str, Any], key: str = "val"
                         ) -> dict[str, float]:
        pred, gold = outputs["pred_tags"], outputs["gold_tags"]
        right = sum(a == b for p, g in zip(pred, gold) for a, b in zip(p, g))
        total = sum(len(g) for g in gold)
        return {**entity_f1(pred, gold), "token_accuracy": right / total if total else 0.0}

    def predict_step(self, global_step: int, batch: dict[str, torch.Tensor],
                     device: torch.device) -> dict[str, Any]:
        """Each row's tags, one per word (``tags``)."""
        return token_rows(self, batch, device)


class CausalLM(HFModule):
    """``AutoModelForCausalLM`` on text, the labels its inputs (padding skipped). Reports
    the token-level ``loss`` over the validation set and its ``perplexity``.

    Example::

        module = CausalLM(TextData("tok", "train.jsonl", max_length=256),
                          config={"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2})
    """

    task = "causal_lm"
    auto_class = "AutoModelForCausalLM"
    shift_labels = True

    def val_step(self, global_step: int, batch: dict[str, torch.Tensor], device: torch.device
                 ) -> dict[str, torch.Tensor]:
        out = self.forward_batch(batch, device)
        nll, tokens = token_nll(out.logits, batch["labels"].to(device), shift=True)
        return {"nll": nll, "tokens": tokens}

    def on_end_val_epoch(self, global_step: int, outputs: dict[str, Any], key: str = "val"
                         ) -> dict[str, float]:
        return perplexity(outputs["nll"], outputs["tokens"])

    def predict_step(self, global_step: int, batch: dict[str, torch.Tensor],
                     device: torch.device) -> dict[str, Any]:
        """Each row continued (``generated``: the new text, greedy, ``max_new_tokens``)."""
        return generated_rows(self, batch, device, causal=True)


class Seq2SeqLM(HFModule):
    """``AutoModelForSeq2SeqLM`` on ``text_column`` -> ``target_column``. Reports the
    target ``loss``/``perplexity`` and ROUGE-1/2/L F1 of what it generates
    (``num_beams``, ``max_new_tokens``; ``generate: false`` skips it).

    Example::

        data = TextData("tok", "train.jsonl", "val.jsonl", target_column="summary")
        module = Seq2SeqLM(data, model_name_or_path="my-bart", num_beams=2, max_new_tokens=16)
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
        nll, tokens = token_nll(out.logits, batch["labels"].to(device), shift=False)
        result: dict[str, Any] = {"nll": nll, "tokens": tokens}
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

    def predict_step(self, global_step: int, batch: dict[str, torch.Tensor],
                     device: torch.device) -> dict[str, Any]:
        """Each row's generated target text (``generated``; ``num_beams``,
        ``max_new_tokens``)."""
        return generated_rows(self, batch, device, causal=False)
