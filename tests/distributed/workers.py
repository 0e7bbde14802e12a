"""Functions the multi-process tests run on every rank (see harness.run_ranks)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Optional

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from sailfin import Callback, Trainer
from tests.recipes import IdData, LinearRecipe, WideRecipe, args, local_bytes


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor, also of a DTensor shard (fsdp; a collective)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class ParamTrace(Callback):
    """Records every parameter after every optimizer step."""

    def __init__(self) -> None:
        self.trace: list[torch.Tensor] = []

    def on_step_end(self, trainer) -> None:
        self.trace.append(torch.cat([full(p.detach()).reshape(-1).clone()
                                     for p in trainer.module.parameters()]))


class CountAllReduce(Callback):
    """Counts gradient all-reduce calls through a DDP communication hook."""

    def __init__(self) -> None:
        self.calls = 0

    def on_train_start(self, trainer) -> None:
        if getattr(trainer.backend, "ddp", None) is None:
            return  # not DDP (fsdp reduce-scatters, counted elsewhere)

        def hook(state, bucket):
            self.calls += 1
            return default_hooks.allreduce_hook(None, bucket)

        trainer.backend.ddp.register_comm_hook(None, hook)


class CountReduceScatter(Callback):
    """Counts FSDP's gradient reduce-scatters (the collective it calls per unit): older
    torch releases (2.9 among them) call ``reduce_scatter_tensor``, newer ones
    ``reduce_scatter_single`` (which the older name then forwards to inside
    ``distributed_c10d``, not through the names patched here, so no call counts twice)."""

    def __init__(self) -> None:
        self.calls = 0

    def on_train_start(self, trainer) -> None:
        for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
            original = getattr(torch.distributed, name, None)
            if original is None:
                continue

            def counted(*args, _original=original, **kwargs):
                self.calls += 1
                return _original(*args, **kwargs)

            setattr(torch.distributed, name, counted)


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


class _InfGradInLastRow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        grad[:, -1] = float("inf")
        return grad


class ShardOverflow(WideRecipe):
    """At step ``bad_step`` only the hidden layer's last row gets an inf gradient: under
    fsdp on 2 ranks, only rank 1's shard holds it. Loss scaled down so that float16
    gradients times the initial loss scale stay finite otherwise."""

    def __init__(self, data, bad_step: int = 2, **kw) -> None:
        super().__init__(data, **kw)
        self.bad_step, self._step = bad_step, 0

    def forward(self, x):
        h = self.hidden(self.dropout(x))
        if self.training and self._step == self.bad_step:
            h = _InfGradInLastRow.apply(h)
        return self.linear(h).squeeze(-1)

    def train_step(self, global_step, batch, device):
        self._step = global_step
        loss, stats = super().train_step(global_step, batch, device)
        return loss * 1e-3, stats


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
    elif kind == "shard_overflow":
        module = ShardOverflow(IdData(**data), **recipe)
    elif kind == "wide":
        module = WideRecipe(IdData(**data), **recipe)
    else:
        module = LinearRecipe(IdData(**data), **recipe)
    trace, counter, scatters = ParamTrace(), CountAllReduce(), CountReduceScatter()
    trainer = {"backend": "ddp", **trainer}
    if "distributed_hang_seconds" in trainer:  # a trainer.distributed setting
        dist_args = dataclasses.replace(dist_args,
                                        hang_seconds=trainer.pop("distributed_hang_seconds"))
    a = args(out / "run", distributed=dist_args, **trainer)
    with Trainer(module, a, callbacks=[trace, counter, scatters]) as t:
        t.end_process_on_hang = True  # a process of its own, as the sailfin command is
        summary = t.train()
        val = t.validate()
        held = {"params": sum(local_bytes(p) for p in module.parameters()),
                "grads": getattr(module, "grad_bytes", None),
                "optimizer": sum(local_bytes(v) for opt in t.optimizers
                                 for per in opt.state.values() for v in per.values()
                                 if isinstance(v, torch.Tensor))}
        params = {k: full(v.detach()).clone() for k, v in module.state_dict().items()}
        backend_state = t.backend.state_dict()
        scheduled = [s.last_epoch for s in t.schedulers]
        ema = t.ema.state_dict() if t.ema is not None else None
        if ema is not None:  # fsdp: shards, gathered here (a collective, in the group)
            ema["shadow"] = {k: full(v).clone() for k, v in ema["shadow"].items()}
    torch.save({"params": params, "held": held, "backend": backend_state,
                "scheduled": scheduled, "reduce_scatter_calls": scatters.calls,
                "seen": module.seen, "step_ids": module.step_ids, "events": module.events,
                "summary": summary, "val": val, "trace": trace.trace,
                "allreduce_calls": counter.calls, "threads": torch.get_num_threads(),
                "ema": ema},
               out / f"rank{rank}.pt")
