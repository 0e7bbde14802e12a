"""Metrics as the field computes them: accuracy, F1, span-level entity F1, perplexity, ROUGE.

They take the validation outputs the trainer has already gathered from every rank
(in dataset order), so each metric is computed once over the whole set.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Sequence

import torch


def accuracy(pred: torch.Tensor, label: torch.Tensor) -> float:
    return (pred == label).float().mean().item() if len(label) else 0.0


def f1_scores(pred: torch.Tensor, label: torch.Tensor, num_labels: int) -> dict[str, float]:
    """Macro F1 over the classes (scikit-learn's ``f1_score(average="macro")``: a class
    with no prediction and no example counts 0), and for two classes the binary F1
    of class 1 (``average="binary"``)."""
    scores = []
    for c in range(num_labels):
        tp = ((pred == c) & (label == c)).sum().item()
        fp = ((pred == c) & (label != c)).sum().item()
        fn = ((pred != c) & (label == c)).sum().item()
        scores.append(2 * tp / (2 * tp + fp + fn) if tp else 0.0)
    present = [c for c in range(num_labels) if (pred == c).any() or (label == c).any()]
    out = {"f1_macro": sum(scores[c] for c in present) / max(1, len(present))}
    out["f1"] = scores[1] if num_labels == 2 else out["f1_macro"]
    return out


def entity_spans(tags: Sequence[str]) -> set[tuple[str, int, int]]:
    """``(type, start, end)`` of each entity in an IOB2/IOB1/IOBES tag sequence, as
    seqeval's default (non-strict) mode reads them: a span starts at ``B-``/``S-``, at
    an ``I-``/``E-`` whose type differs from the previous tag's, or after ``O``; it
    ends before ``O``, a ``B-``/``S-``, or a change of type, and after ``E-``/``S-``."""
    spans: set[tuple[str, int, int]] = set()
    start, kind, prev_prefix = None, None, "O"
    for i, tag in enumerate(list(tags) + ["O"]):
        prefix, _, typ = tag.partition("-") if tag not in ("O", "") else ("O", "", "")
        if "-" not in tag and tag != "O":  # a tag without a prefix: its own type
            prefix, typ = "I", tag
        ends = kind is not None and (
            prefix in ("O", "B", "S") or typ != kind or prev_prefix in ("E", "S"))
        if ends:
            spans.add((kind, start, i - 1))
            start, kind = None, None
        if prefix != "O" and kind is None:
            start, kind = i, typ
        prev_prefix = prefix
    return spans


def entity_f1(pred_tags: Sequence[Sequence[str]], gold_tags: Sequence[Sequence[str]]
              ) -> dict[str, float]:
    """Micro precision, recall and F1 over entity spans (an entity counts only if its
    type and both ends match): seqeval's ``classification_report`` micro average."""
    tp = n_pred = n_gold = 0
    for pred, gold in zip(pred_tags, gold_tags):
        p, g = entity_spans(pred), entity_spans(gold)
        tp += len(p & g)
        n_pred += len(p)
        n_gold += len(g)
    precision = tp / n_pred if n_pred else 0.0
    recall = tp / n_gold if n_gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"entity_precision": precision, "entity_recall": recall, "entity_f1": f1}


def perplexity(nll_sum: torch.Tensor, tokens: torch.Tensor) -> dict[str, float]:
    """From per-sample summed negative log-likelihood and token counts: the token-level
    mean loss over the whole set and ``exp`` of it."""
    total = tokens.sum().item()
    loss = nll_sum.sum().item() / total if total else float("nan")
    return {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else float("inf")}


# ROUGE-1/2/L F-measure (Lin, 2004) on lower-cased runs of letters and digits: the default
# tokenizer of Google's rouge-score package, without stemming.
_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _f1(overlap: int, n_pred: int, n_ref: int) -> float:
    if not overlap:
        return 0.0
    p, r = overlap / n_pred, overlap / n_ref
    return 2 * p * r / (p + r)


def rouge_n(pred: Sequence[str], ref: Sequence[str], n: int) -> float:
    """F1 of the clipped n-gram overlap of two word lists."""
    grams = lambda w: Counter(tuple(w[i:i + n]) for i in range(len(w) - n + 1))  # noqa: E731
    p, r = grams(pred), grams(ref)
    return _f1(sum((p & r).values()), sum(p.values()), sum(r.values()))


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    row = [0] * (len(b) + 1)
    for x in a:
        prev = 0
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], prev + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


def rouge_l(pred: Sequence[str], ref: Sequence[str]) -> float:
    return _f1(lcs_length(pred, ref), len(pred), len(ref))


def rouge(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Mean ROUGE-1/2/L F1 over the pairs: ``rouge(["the cat sat"], ["the cat sat down"])``
    gives rouge1 0.857, rouge2 0.8, rougeL 0.857."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
    pairs = [(words(pred), words(ref)) for pred, ref in zip(predictions, references)]
    n = max(1, len(pairs))
    return {"rouge1": sum(rouge_n(p, r, 1) for p, r in pairs) / n,
            "rouge2": sum(rouge_n(p, r, 2) for p, r in pairs) / n,
            "rougeL": sum(rouge_l(p, r) for p, r in pairs) / n}
