"""One rank of a 2-process fsdp run of an HF module (spawned by tests/distributed/harness)."""

from __future__ import annotations

import torch

from tests.hf.helpers import NO_DROPOUT, args, module


def train_rank(rank, world, dist_args, out, task, data_dir, trainer):
    from sailfin import Trainer, seed_everything

    seed_everything(0)
    m = module(task, data_dir, config_kw=NO_DROPOUT[task])
    total = sum(p.numel() for p in m.parameters())
    with Trainer(m, args(out / "run", backend="fsdp", distributed=dist_args, **trainer)) as t:
        summary = t.train()
        held = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                   for p in m.parameters())
        torch.save({"summary": summary, "units": list(t.backend.units), "held": held,
                    "total": total}, out / f"rank{rank}.pt")
