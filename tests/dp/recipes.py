"""Recipes and per-rank functions of the differential-privacy tests."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch import nn

from sailfin import Trainer, TrainerArguments
from tests.recipes import IdData, LinearRecipe


class NormRecipe(LinearRecipe):
    """LinearRecipe with a normalisation layer in front (BatchNorm: refused by dp)."""

    def __init__(self, data, norm: str = "batch") -> None:
        super().__init__(data)
        self.norm = nn.BatchNorm1d(4) if norm == "batch" else nn.GroupNorm(1, 4)

    def forward(self, x):  # [B, 4] -> [B, 4, 2]: two values per channel to normalise
        return self.linear(self.norm(torch.stack([x, x * x], -1)).mean(-1)).squeeze(-1)


class PerSampleRecipe(LinearRecipe):
    """Returns the per-sample losses (what ghost clipping needs)."""

    def train_step(self, global_step, batch, device):
        ids, x, y = batch
        if not self.padding_batch:
            self.seen.append(ids.tolist())
        return nn.functional.mse_loss(self(x.to(device)), y.to(device), reduction="none")


class WidePerSample(PerSampleRecipe):
    """Per-sample losses through 4 -> 3 -> 2 linear layers (no parameter with a first
    dimension of 1: fsdp shards dimension 0, and Opacus's FSDP step needs rows on every
    rank), the prediction the mean of the two outputs."""

    def __init__(self, data) -> None:
        super().__init__(data)
        torch.manual_seed(0)
        self.hidden, self.linear = nn.Linear(4, 3), nn.Linear(3, 2)

    def forward(self, x):
        return self.linear(torch.tanh(self.hidden(x))).mean(-1)


class SlowWidePerSample(WidePerSample):
    """WidePerSample whose steps take ``step_seconds``: a job can be killed mid-run."""

    def __init__(self, data, step_seconds: float = 0.0) -> None:
        super().__init__(data)
        self.step_seconds = step_seconds

    def train_step(self, global_step, batch, device):
        if self.step_seconds:
            time.sleep(self.step_seconds)
        return super().train_step(global_step, batch, device)


def dp_args(out, **kw) -> TrainerArguments:
    dp = {"noise_multiplier": 1.1, "max_grad_norm": 1.0, **kw.pop("dp", {})}
    base = dict(backend="sp-dp", epochs=2, train_batch_size=10, micro_batch_size=5, seed=3,
                output_dir=str(out), writers=["jsonl"], progress="none", log_every_n_steps=1,
                dp=dp)
    base.update(kw)
    return TrainerArguments(**base)


def train_dp_rank(rank, world, dist_args, out, backend="ddp-dp", n=47, per_sample=False,
                  dp=None):
    """One rank of a ddp-dp (or fsdp-dp) run; rank 0 writes its final parameters (full
    tensors, gathered under fsdp) and the privacy summary."""
    args = dp_args(out / "run", backend=backend, distributed=dist_args, dp=dp or {})
    module = (WidePerSample if per_sample else LinearRecipe)(IdData(n, 9))
    with Trainer(module, args) as trainer:
        summary = trainer.train()
        weights = trainer.backend.final_state_dict(module)  # every rank: a collective
    seen = [i for ids in module.seen for i in ids]
    (out / f"seen-{rank}.json").write_text(json.dumps(seen))
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in weights.items()}, out / "weights.pt")
        Path(out, "privacy.json").write_text(json.dumps(summary["privacy"]))


class Residual(nn.Module):
    """torchvision's BasicBlock in small: conv-bn-relu-conv-bn, then ``out += identity``."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Linear(channels, channels)
        self.bn1 = nn.BatchNorm1d(channels)
        self.relu = nn.ReLU()
        self.conv2 = nn.Linear(channels, channels)
        self.bn2 = nn.BatchNorm1d(channels)

    def forward(self, x):
        identity = x
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        out += identity  # in place, on a hooked layer's output
        return self.relu(out)


class ResidualRecipe(LinearRecipe):
    """A linear head on a residual block that adds its shortcut in place."""

    def __init__(self, data) -> None:
        super().__init__(data)
        self.block = Residual(4)

    def forward(self, x):
        return self.linear(self.block(x)).squeeze(-1)
