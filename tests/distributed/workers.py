"""Functions the multi-process tests run on every rank (see harness.run_ranks)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Optional

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from sailfin import Callback, Trainer
from tests.recipes import IdData, LinearRecipe, args


class ParamTrace(Callback):
    """Records every parameter after every optimizer step."""

    def __init__(self) -> None:
        self.trace: list[torch.Tensor] = []

    def on_step_end(self, trainer) -> None:
        self.trace.append(torch.cat([p.detach().reshape(-1).clone()
                                     for p in trainer.module.parameters()]))


class CountAllReduce(Callback):
    """Counts gradient all-reduce calls through a DDP communication hook."""

    def __init__(self) -> None:
        self.calls = 0

    def on_train_start(self, trainer) -> None:
        def hook(state, bucket):
            self.calls += 1
            return default_hooks.allreduce_hook(None, bucket)

        trainer.backend.ddp.register_comm_hook(None, hook)


class FailingRecipe(LinearRecipe):
    def __init__(self, data, fail_rank: int, fail_step: int, rank: int, **kw) -> None:
        super().__init__(data, **kw)
        self.fail = rank == fail_rank
        self.fail_step = fail_step

    def train_step(self, global_step, batch, device):
        if self.fail and global_step == self.fail_step:
            raise RuntimeError(f"recipe failed on purpose at step {global_step}")
        return super().train_step(global_step, batch, device)


class HangingRecipe(LinearRecipe):
    """Rank ``hang_rank`` sleeps forever inside train_step of step ``hang_step`` (1-based,
    as logs count), after writing the time it began to ``<marker>``."""

    def __init__(self, data, hang_rank: int, hang_step: int, rank: int, marker: str,
                 **kw) -> None:
        super().__init__(data, **kw)
        self.hang = rank == hang_rank
        self.hang_step, self.marker = hang_step, marker

    def train_step(self, global_step, batch, device):
        if self.hang and global_step + 1 == self.hang_step:
            Path(self.marker).write_text(repr(time.time()))
            while True:
                time.sleep(3600)
        return super().train_step(global_step, batch, device)


class SlowRankRecipe(LinearRecipe):
    """Rank ``slow_rank`` takes ``seconds`` longer over each forward (a straggler)."""

    def __init__(self, data, slow_rank: int, seconds: float, rank: int, **kw) -> None:
        super().__init__(data, **kw)
        self.delay = seconds if rank == slow_rank else 0.0

    def train_step(self, global_step, batch, device):
        if self.delay:
            time.sleep(self.delay)
        return super().train_step(global_step, batch, device)


class NamedOutputs(LinearRecipe):
    """val_step also returns a list of strings and a per-batch Python number."""

    def val_step(self, global_step, batch, device):
        out = super().val_step(global_step, batch, device)
        out["name"] = [f"s{i}" for i in batch[0].tolist()]
        return out

    def on_end_val_epoch(self, global_step, outputs, key="val"):
        self.events.append(("names", outputs["name"]))
        return super().on_end_val_epoch(global_step, outputs, key)


class CollectiveRecipe(LinearRecipe):
    """train_step all-reduces on every forward, as a contrastive loss's all-gather does."""

    def train_step(self, global_step, batch, device):
        count = torch.tensor([float(len(batch[0]))])
        torch.distributed.all_reduce(count)
        self.events.append(("forward_samples", global_step, count.item()))
        return super().train_step(global_step, batch, device)


def train(rank: int, world: int, dist_args, out: Path, data: dict, trainer: dict,
          recipe: Optional[dict] = None, kind: str = "linear") -> None:
    recipe = dict(recipe or {})
    if kind == "failing":
        module = FailingRecipe(IdData(**data), rank=rank, **recipe)
    elif kind == "collective":
        module = CollectiveRecipe(IdData(**data), **recipe)
    elif kind == "hang":
        module = HangingRecipe(IdData(**data), rank=rank, **recipe)
    elif kind == "slow":
        module = SlowRankRecipe(IdData(**data), rank=rank, **recipe)
    elif kind == "oom":
        from tests.trainer.oom_recipes import OomRecipe
        module = OomRecipe(IdData(**data), rank=rank, **recipe)
    elif kind == "named":
        module = NamedOutputs(IdData(**data), **recipe)
    else:
        module = LinearRecipe(IdData(**data), **recipe)
    trace, counter = ParamTrace(), CountAllReduce()
    trainer = {"backend": "ddp", **trainer}
    if "distributed_hang_seconds" in trainer:  # a trainer.distributed setting
        dist_args = dataclasses.replace(dist_args,
                                        hang_seconds=trainer.pop("distributed_hang_seconds"))
    a = args(out / "run", distributed=dist_args, **trainer)
    with Trainer(module, a, callbacks=[trace, counter]) as t:
        summary = t.train()
        val = t.validate()
    torch.save({"params": {k: v.detach().clone() for k, v in module.state_dict().items()},
                "seen": module.seen, "step_ids": module.step_ids, "events": module.events,
                "summary": summary, "val": val, "trace": trace.trace,
                "allreduce_calls": counter.calls, "threads": torch.get_num_threads()},
               out / f"rank{rank}.pt")
