"""Handwritten digits (scikit-learn's bundled 8x8 images) with a small MLP.

Runs offline: the data set ships inside scikit-learn.

    sailfin train examples/digits/config.yaml
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from sailfin import DataInterface, ModuleInterface


class DigitsData(DataInterface):
    """1,797 8x8 digit images, split into train and validation by a fixed seed."""

    def __init__(self, val_fraction: float = 0.2, split_seed: int = 0) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
        y = torch.tensor(digits.target, dtype=torch.long)
        order = np.random.default_rng(split_seed).permutation(len(x))
        n_val = int(len(x) * val_fraction)
        val, train = order[:n_val], order[n_val:]
        self.train = torch.utils.data.TensorDataset(x[train], y[train])
        self.val = torch.utils.data.TensorDataset(x[val], y[val])

    def get_train_dataset(self):
        return self.train

    def get_val_dataset(self):
        return self.val


class DigitsClassifier(ModuleInterface):
    """An MLP 64 -> hidden -> hidden -> 10, trained with AdamW and a cosine schedule."""

    def __init__(self, data: DigitsData, hidden: int = 128, lr: float = 3e-3,
                 weight_decay: float = 1e-4, dropout: float = 0.1) -> None:
        super().__init__()
        self.data = data
        self.lr, self.weight_decay = lr, weight_decay
        self.net = nn.Sequential(
            nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        total = max(1, estimated_global_steps_per_epoch * epochs)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.lr, total_steps=total)
        return [opt], [sched]

    def train_step(self, global_step, batch, device):
        x, y = batch[0].to(device), batch[1].to(device)
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        return loss, {"train_accuracy": (logits.argmax(1) == y).float().mean()}

    def val_step(self, global_step, batch, device):
        x, y = batch[0].to(device), batch[1].to(device)
        logits = self(x)
        return {"loss": nn.functional.cross_entropy(logits, y, reduction="none"),
                "pred": logits.argmax(1), "label": y}

    def on_end_val_epoch(self, global_step, outputs, key="val"):
        return {"loss": outputs["loss"].mean().item(),
                "accuracy": (outputs["pred"] == outputs["label"]).float().mean().item()}

    def predict_step(self, global_step, batch, device):
        """``sailfin predict``: each image's digit and the model's confidence in it."""
        probs = self(batch[0].to(device)).softmax(1)
        score, label = probs.max(1)
        return {"label": label, "score": score}
