"""The metrics against scikit-learn and hand-computed references on fixed predictions."""

import math

import pytest
import torch

from sailfin.hf.metrics import accuracy, entity_f1, entity_spans, f1_scores, perplexity
from sailfin.hf.metrics import lcs_length, rouge

sklearn_metrics = pytest.importorskip("sklearn.metrics")


@pytest.mark.parametrize("num_labels", [2, 4])
def test_accuracy_and_f1_equal_scikit_learn(num_labels):
    g = torch.Generator().manual_seed(num_labels)
    label = torch.randint(0, num_labels, (200,), generator=g)
    pred = torch.where(torch.rand(200, generator=g) < 0.6, label,
                       torch.randint(0, num_labels, (200,), generator=g))
    pred[pred == num_labels - 1] = 0  # a class never predicted: its F1 is 0
    got = f1_scores(pred, label, num_labels)
    assert accuracy(pred, label) == pytest.approx(sklearn_metrics.accuracy_score(label, pred))
    assert got["f1_macro"] == pytest.approx(
        sklearn_metrics.f1_score(label, pred, average="macro", zero_division=0))
    average = "binary" if num_labels == 2 else "macro"
    assert got["f1"] == pytest.approx(
        sklearn_metrics.f1_score(label, pred, average=average, zero_division=0))


def test_entity_spans_read_iob2_iob1_and_iobes_as_seqeval():
    assert entity_spans(["B-PER", "I-PER", "O", "B-LOC"]) == {("PER", 0, 1), ("LOC", 3, 3)}
    # I- after O starts an entity; a type change starts a new one (seqeval's default mode).
    assert entity_spans(["O", "I-PER", "I-LOC", "I-LOC"]) == {("PER", 1, 1), ("LOC", 2, 3)}
    assert entity_spans(["B-PER", "B-PER"]) == {("PER", 0, 0), ("PER", 1, 1)}
    assert entity_spans(["S-PER", "B-LOC", "E-LOC", "I-LOC"]) == {
        ("PER", 0, 0), ("LOC", 1, 2), ("LOC", 3, 3)}


def test_entity_f1_by_hand():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]
    pred = [["B-PER", "I-PER", "O", "O"], ["B-ORG", "B-ORG"]]
    # gold spans 3; predicted 3 (PER 0-1, ORG 0-0, ORG 1-1); right 2.
    got = entity_f1(pred, gold)
    assert got["entity_precision"] == pytest.approx(2 / 3)
    assert got["entity_recall"] == pytest.approx(2 / 3)
    assert got["entity_f1"] == pytest.approx(2 / 3)
    # A span with one end wrong counts nothing.
    assert entity_f1([["B-PER", "O"]], [["B-PER", "I-PER"]])["entity_f1"] == 0.0


def test_perplexity_is_exp_of_the_token_mean():
    got = perplexity(torch.tensor([2.0, 6.0]), torch.tensor([1, 3]))
    assert got["loss"] == pytest.approx(2.0)
    assert got["perplexity"] == pytest.approx(math.exp(2.0))


def test_rouge_by_hand():
    # pred "the cat sat", ref "the cat sat down": unigrams 3/3 and 3/4 -> F1 6/7;
    # bigrams 2/2 and 2/3 -> 0.8; LCS 3 -> 6/7.
    got = rouge(["The cat sat"], ["the cat, sat down"])
    assert got == pytest.approx({"rouge1": 6 / 7, "rouge2": 0.8, "rougeL": 6 / 7})
    # "a b c d" vs "a c b d": LCS 3 (a b d), bigrams share none.
    got = rouge(["a b c d"], ["a c b d"])
    assert got["rouge2"] == 0.0 and got["rougeL"] == pytest.approx(0.75)
    assert lcs_length("abcbdab", "bdcaba") == 4
    assert rouge(["x"], ["y"]) == {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    # Means over pairs.
    assert rouge(["a", "b"], ["a", "c"])["rouge1"] == pytest.approx(0.5)
