"""PyMarlin's covid19_text_classification example (tweets in five sentiment classes),
written for sailfin in PyMarlin's own form: the module takes its settings as one
unannotated ``args`` and reads them as attributes (``args.max_lr``), ``val_step``
returns PyMarlin's ``(losses, logits, labels)`` tuple and ``on_end_val_epoch`` takes
those columns by position with ``key="default"``.

PyMarlin's example fine-tunes BERT on a Kaggle download. This port runs offline: the
tweets are generated (sentiment words mixed into neutral ones, the class set by their
balance, with label noise), the model is a bag of word embeddings, and the test split
(``get_test_dataset``) is read only by ``sailfin evaluate --split test``.

    sailfin train examples/covid19_text_classification/config.yaml
"""

from __future__ import annotations

import logging
import random
from collections import Counter

import torch
from torch import nn

from sailfin import DataInterface, ModuleInterface

LABELS = ["Extremely Negative", "Negative", "Neutral", "Positive", "Extremely Positive"]
GOOD = "good great safe recovered hope thanks happy helpful stocked calm kind".split()
BAD = "panic empty scared closed shortage crisis worried sick angry greed chaos".split()
NEUTRAL = ("store shelves people masks queue supermarket prices online delivery today "
           "week home food toilet paper lockdown covid virus news local shop").split()


def tweets(n: int, seed: int) -> list[tuple[str, int]]:
    """``n`` tweets and labels: the label follows (good words - bad words), 10% flipped."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        good, bad = rng.randint(0, 3), rng.randint(0, 3)
        words = ([rng.choice(GOOD) for _ in range(good)] + [rng.choice(BAD) for _ in range(bad)]
                 + [rng.choice(NEUTRAL) for _ in range(rng.randint(3, 10))])
        rng.shuffle(words)
        label = max(-2, min(2, good - bad)) + 2
        if rng.random() < 0.1:
            label = rng.randrange(len(LABELS))
        out.append((" ".join(words), label))
    return out


class TweetSentData(DataInterface):
    """Train, validation and test tweets, tokenized into word ids (0: padding, 1: unknown)."""

    def __init__(self, n_train: int = 2000, n_val: int = 400, n_test: int = 401,
                 max_words: int = 16, seed: int = 0) -> None:
        train = tweets(n_train, seed)
        counts = Counter(w for text, _ in train for w in text.split())
        self.vocab = {w: i + 2 for i, (w, _) in enumerate(sorted(counts.items()))}
        self.max_words = max_words
        self.train = self._encode(train)
        self.val = self._encode(tweets(n_val, seed + 1))
        self.test = self._encode(tweets(n_test, seed + 2))

    def _encode(self, rows: list[tuple[str, int]]) -> torch.utils.data.TensorDataset:
        ids = torch.zeros(len(rows), self.max_words, dtype=torch.long)
        for r, (text, _) in enumerate(rows):
            words = [self.vocab.get(w, 1) for w in text.split()][:self.max_words]
            ids[r, :len(words)] = torch.tensor(words)
        return torch.utils.data.TensorDataset(ids, torch.tensor([y for _, y in rows]))

    def get_train_dataset(self):
        return self.train

    def get_val_dataset(self):
        return self.val

    def get_test_dataset(self):
        return self.test


class TweetSentModule(ModuleInterface):
    """PyMarlin's form: ``args`` (a namespace of ``init_args.args``) and ``data``."""

    def __init__(self, args, data: TweetSentData) -> None:
        super().__init__()
        self.args, self.data = args, data
        self.logger = logging.getLogger(__name__)
        self.logger.setLevel(args.log_level)
        self.embed = nn.EmbeddingBag(len(data.vocab) + 2, args.embed_dim, padding_idx=0)
        self.classifier = nn.Linear(args.embed_dim, len(LABELS))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.embed(ids))

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.args.max_lr)
        total = max(1, estimated_global_steps_per_epoch * epochs)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.args.max_lr,
                                                        total_steps=total)
        return [optimizer], [scheduler]

    def train_step(self, global_step, batch, device):
        ids, labels = batch[0].to(device), batch[1].to(device)
        return nn.functional.cross_entropy(self(ids), labels)

    def val_step(self, global_step, batch, device):
        ids, labels = batch[0].to(device), batch[1].to(device)
        logits = self(ids)
        return nn.functional.cross_entropy(logits, labels, reduction="none"), logits, labels

    def on_end_val_epoch(self, global_step, losses, logits, labels, key="default"):
        accuracy = (logits.argmax(-1) == labels).float().mean().item()
        self.logger.debug("step %d %s: accuracy %.4f", global_step, key, accuracy)
        return {"loss": losses.mean().item(), "accuracy": accuracy}

    def predict_step(self, global_step, batch, device):
        probs = self(batch[0].to(device)).softmax(-1)
        score, label = probs.max(-1)
        return {"sentiment": [LABELS[i] for i in label.tolist()], "score": score}
