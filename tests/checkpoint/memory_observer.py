"""A run with memory snapshots against the same run without them: the recipe (AdamW, whose
step count and bias correction see any extra step) and one rank's training."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from sailfin import Trainer
from tests.recipes import IdData, WideRecipe, args

#: The ways a run takes snapshots, each compared with the run without them.
VARIANTS: dict[str, dict[str, Any]] = {
    "every-step": {"memory": {"every_n_steps": 1}},
    "persisted": {"memory": {"every_n_steps": 1, "persist_every_n_steps": 3}},
    "async-save": {"every_n_steps": 4, "async_save": True, "memory": {"every_n_steps": 1}},
}


class AdamWRecipe(WideRecipe):
    """WideRecipe trained with AdamW (weight decay on): one step too many shows."""

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        opt = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.8)]


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def train(out: Path, backend: str, variant: Optional[str], dist_args: Any = None,
          **extra: Any) -> dict[str, Any]:
    """Train the recipe; its final weights and each optimizer's step counts."""
    checkpoint: dict[str, Any] = {"at_epoch_end": False}
    if variant is not None:
        checkpoint.update(VARIANTS[variant])
        checkpoint["memory"] = {**checkpoint["memory"], "dir": str(out / "shm")}
    kw: dict[str, Any] = dict(backend=backend, epochs=2, train_batch_size=10,
                              micro_batch_size=5, checkpoint=checkpoint, progress="none")
    if backend.endswith("-dp"):
        kw["dp"] = {"noise_multiplier": 1.1, "max_grad_norm": 1.0}
    if dist_args is not None:
        kw["distributed"] = dist_args
    module = AdamWRecipe(IdData(47, 0), dropout=0.1)
    with Trainer(module, args(out / "run", **{**kw, **extra})) as trainer:
        trainer.train()
        steps = sorted({float(s["step"]) for opt in trainer.optimizers
                        for s in opt.state.values() if "step" in s})
        weights = {k: full(v.detach()).clone() for k, v in module.state_dict().items()}
    return {"weights": weights, "steps": steps}


def train_rank(rank: int, world: int, dist_args: Any, out: Path, backend: str,
               variant: Optional[str]) -> None:
    """One rank of a 2-process run (tests.distributed.harness.run_ranks); rank 0 saves."""
    result = train(out, backend, variant, dist_args)
    if rank == 0:
        torch.save(result, out / "result.pt")


def node_bytes_rank(rank: int, world: int, dist_args: Any, out: Path) -> None:
    """One rank of a 2-process ddp run with snapshots every step; rank 0 records, at each
    step from the third (both ranks' previous snapshots committed), the bytes of the
    node's directory, the steps its committed headers name, and one rank's state (model,
    optimizer, trainer, random streams)."""
    import dataclasses
    import os

    from sailfin import Callback
    from sailfin.checkpoint.rng import rng_state
    from sailfin.checkpoint.snapshot_dirs import used_bytes
    from sailfin.trainer.checkpointing.memory_snapshots import snapshots_of, state_bytes
    from tests.checkpoint.test_memory import steps_held

    class NodeBytes(Callback):
        seen: list = []

        def on_step_end(self, trainer) -> None:
            store = snapshots_of(trainer).store
            store.wait()
            trainer.backend.barrier()
            if trainer.global_step >= 3 and rank == 0:
                ranks = [d for d in os.listdir(store.root) if d.startswith("rank")]
                kept = {s for d in ranks
                        for s in steps_held(os.path.join(store.root, d)).values()}
                self.seen.append((used_bytes(store.root), len(kept),
                                  state_bytes(trainer.state_dict()) + state_bytes(rng_state())))
            trainer.backend.barrier()

    # Both ranks on one node, as torchrun would say.
    dist_args = dataclasses.replace(dist_args, local_rank=rank, local_world_size=world)
    module = AdamWRecipe(IdData(47, 0), hidden=1 << 14)
    checkpoint = {"memory": {"every_n_steps": 1, "dir": str(out / "shm")}}
    node = NodeBytes()
    with Trainer(module, args(out / "run", backend="ddp", epochs=1, train_batch_size=10,
                              micro_batch_size=5, checkpoint=checkpoint, progress="none",
                              distributed=dist_args), callbacks=[node]) as trainer:
        trainer.train()
    if rank == 0:
        torch.save(node.seen, out / "node-bytes.pt")
