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


def export_rank(rank, world, dist_args, out, config_text):
    """A run built from a YAML as `sailfin train` builds it (so its checkpoints record the
    recipe), trained under fsdp with a checkpoint at the end."""
    import dataclasses

    import yaml

    from sailfin import Trainer
    from sailfin.config import from_dict

    cfg = from_dict(yaml.safe_load(config_text))
    m = cfg.build()
    trainer = dataclasses.replace(cfg.trainer, distributed=dist_args)
    with Trainer(m, trainer) as t:
        t.train()


def lora_rank(rank, world, dist_args, out, task, data_dir, backend, trainer):
    """One rank of a LoRA run (dropout 0) under ``backend``; final weights in out/run."""
    from sailfin import Trainer, seed_everything

    seed_everything(0)
    m = module(task, data_dir, config_kw=NO_DROPOUT[task],
               peft={"r": 4, "lora_alpha": 8, "lora_dropout": 0.0})
    with Trainer(m, args(out / "run", backend=backend, distributed=dist_args, **trainer)) as t:
        t.train()
