"""Recipes and per-rank functions of the differential-privacy tests."""

from __future__ import annotations

import json
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


def dp_args(out, **kw) -> TrainerArguments:
    dp = {"noise_multiplier": 1.1, "max_grad_norm": 1.0, **kw.pop("dp", {})}
    base = dict(backend="sp-dp", epochs=2, train_batch_size=10, micro_batch_size=5, seed=3,
                output_dir=str(out), writers=["jsonl"], progress="none", log_every_n_steps=1,
                dp=dp)
    base.update(kw)
    return TrainerArguments(**base)


def train_dp_rank(rank, world, dist_args, out, backend="ddp-dp", n=47):
    """One rank of a ddp-dp run; rank 0 writes its final parameters and epsilon."""
    args = dp_args(out / "run", backend=backend, distributed=dist_args)
    module = LinearRecipe(IdData(n, 9))
    with Trainer(module, args) as trainer:
        summary = trainer.train()
    seen = [i for ids in module.seen for i in ids]
    (out / f"seen-{rank}.json").write_text(json.dumps(seen))
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in module.state_dict().items()},
                   out / "weights.pt")
        Path(out, "privacy.json").write_text(json.dumps(summary["privacy"]))
