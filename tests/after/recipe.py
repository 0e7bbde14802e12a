"""A tiny classifier whose samples carry their own position (feature 0), so a test can
see which sample each output came from; 37 validation and 23 test samples (odd sizes)."""

from __future__ import annotations

import time

import torch
from torch import nn

from sailfin import DataInterface, ModuleInterface


class PositionData(DataInterface):
    def __init__(self, n_train: int = 64, n_val: int = 37, n_test: int = 23) -> None:
        def make(n: int, seed: int) -> torch.utils.data.TensorDataset:
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(n, 6, generator=g)
            x[:, 0] = torch.arange(n, dtype=torch.float32)  # the sample's position
            y = (x[:, 1] + x[:, 2] > 0).long()
            return torch.utils.data.TensorDataset(x, y)

        self.train, self.val, self.test = make(n_train, 0), make(n_val, 1), make(n_test, 2)

    def get_train_dataset(self):
        return self.train

    def get_val_dataset(self):
        return self.val

    def get_test_dataset(self):
        return self.test


class PositionClassifier(ModuleInterface):
    def __init__(self, data: PositionData, lr: float = 0.1, slow_predict: float = 0.0,
                 fail_predict_at: int = -1) -> None:
        super().__init__()
        self.data, self.lr = data, lr
        self.slow_predict, self.fail_predict_at = slow_predict, fail_predict_at
        self.net = nn.Sequential(nn.Linear(5, 16), nn.BatchNorm1d(16), nn.ReLU(),
                                 nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x[:, 1:])  # feature 0 (the position) is not an input

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [torch.optim.SGD(self.parameters(), lr=self.lr)], []

    def train_step(self, global_step, batch, device):
        x, y = batch[0].to(device), batch[1].to(device)
        return nn.functional.cross_entropy(self(x), y)

    def val_step(self, global_step, batch, device):
        x, y = batch[0].to(device), batch[1].to(device)
        logits = self(x)
        return {"loss": nn.functional.cross_entropy(logits, y, reduction="none"),
                "mean_loss": nn.functional.cross_entropy(logits, y),  # 0-d: per sample
                "pred": logits.argmax(1), "label": y, "position": x[:, 0]}

    def on_end_val_epoch(self, global_step, outputs, key="val"):
        return {"loss": outputs["loss"].mean().item(),
                "mean_loss": outputs["mean_loss"].mean().item(),
                "accuracy": (outputs["pred"] == outputs["label"]).float().mean().item(),
                "positions": float(outputs["position"].sum().item()),
                "count": float(len(outputs["label"]))}

    def predict_step(self, global_step, batch, device):
        x = batch[0].to(device)
        if self.slow_predict:
            time.sleep(self.slow_predict)
        if 0 <= self.fail_predict_at <= int(x[0, 0]):
            raise RuntimeError(f"predict_step failed at sample {int(x[0, 0])}")
        logits = self(x)
        return {"position": x[:, 0].long(), "label": logits.argmax(1),
                "logits": logits, "text": [f"s{int(i)}" for i in x[:, 0]]}


def reference(module: PositionClassifier, dataset) -> dict:
    """A hand-written evaluation and prediction pass: one process, the whole set at once."""
    module.eval()
    with torch.no_grad():
        x, y = dataset.tensors
        logits = module(x)
    losses = nn.functional.cross_entropy(logits, y, reduction="none")
    return {"loss": losses.mean().item(),
            "accuracy": (logits.argmax(1) == y).float().mean().item(),
            "labels": logits.argmax(1).tolist(), "logits": logits.tolist()}
