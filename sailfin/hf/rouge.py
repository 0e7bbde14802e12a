"""ROUGE-1, ROUGE-2 and ROUGE-L (F-measure), as Lin (2004) defines them.

Text is lower-cased and split into runs of letters and digits (the default
tokenizer of Google's ``rouge-score`` package, without stemming); each score
is the F1 of the n-gram (or longest-common-subsequence) overlap per pair,
averaged over the pairs.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Sequence

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
    """Mean ROUGE-1/2/L F1 over the pairs.

    Example::

        rouge(["the cat sat"], ["the cat sat down"])   # rouge1 0.857, rouge2 0.8, rougeL 0.857
    """
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
    totals = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    for pred, ref in zip(predictions, references):
        p, r = words(pred), words(ref)
        totals["rouge1"] += rouge_n(p, r, 1)
        totals["rouge2"] += rouge_n(p, r, 2)
        totals["rougeL"] += rouge_l(p, r)
    n = max(1, len(predictions))
    return {k: v / n for k, v in totals.items()}
