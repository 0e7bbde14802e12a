"""Metrics as the field computes them: accuracy, F1, span-level entity F1, perplexity.

They take the validation outputs the trainer has already gathered from every rank
(in dataset order), so each metric is computed once over the whole set.
"""

from __future__ import annotations

import math
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
    if num_labels == 2:
        out["f1"] = scores[1]
    else:
        out["f1"] = out["f1_macro"]
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
