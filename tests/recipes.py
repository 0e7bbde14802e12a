"""Small recipes the tests train. Every sample carries its id, so tests can see
exactly which samples formed each step."""

from __future__ import annotations

import torch
from torch import nn

from sailfin import DataInterface, ModuleInterface, TrainerArguments


class IdDataset(torch.utils.data.Dataset):
    """Sample i is (i, x_i, y_i), a deterministic function of i (a noisy linear target)."""

    def __init__(self, n: int, dim: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        w = torch.arange(1, dim + 1, dtype=torch.float32)
        self.y = self.x @ w + 0.1 * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


class IdData(DataInterface):
    def __init__(self, n_train: int = 100, n_val: int = 30, dim: int = 4) -> None:
        self.train = IdDataset(n_train, dim, seed=1)
        self.val = IdDataset(n_val, dim, seed=2) if n_val else None

    def get_train_dataset(self):
        return self.train

    def get_val_dataset(self):
        return self.val


class LinearRecipe(ModuleInterface):
    """Linear regression with SGD; records the sample ids of every micro-batch."""

    def __init__(self, data: IdData, dim: int = 4, lr: float = 0.05, dropout: float = 0.0,
                 momentum: float = 0.0) -> None:
        super().__init__()
        self.data = data
        self.lr, self.momentum = lr, momentum
        torch.manual_seed(0)
        self.linear = nn.Linear(dim, 1)
        self.dropout = nn.Dropout(dropout)
        self.seen: list[list[int]] = []       # ids per micro-batch, in order
        self.step_ids: list[list[int]] = []   # ids per optimizer step
        self._pending: list[int] = []
        self.events: list[tuple] = []

    def forward(self, x):
        return self.linear(self.dropout(x)).squeeze(-1)

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
        return [opt], [sched]

    def train_step(self, global_step, batch, device):
        ids, x, y = batch
        if not self.padding_batch:  # a weight-0 padding sample is not a sample seen
            self.seen.append(ids.tolist())
            self._pending.extend(ids.tolist())
        loss = nn.functional.mse_loss(self(x.to(device)), y.to(device))
        return loss, {"batch_size": torch.tensor(float(len(ids)))}

    def val_step(self, global_step, batch, device):
        ids, x, y = batch
        pred = self(x.to(device))
        return {"id": ids, "sq_err": (pred - y.to(device)) ** 2}

    def on_end_val_epoch(self, global_step, outputs, key="val"):
        if not self.sanity_checking:  # the check before step 1 is not a validation
            self.events.append(("val", global_step, key, outputs["id"].tolist()))
        return {"mse": outputs["sq_err"].mean().item(), "count": len(outputs["id"])}

    def on_begin_train_epoch(self, global_step, epoch):
        self.events.append(("begin_epoch", global_step, epoch))

    def on_end_backward(self, global_step, loss):
        self.events.append(("end_backward", global_step))

    def on_end_train_step(self, global_step, loss, stats):
        self.step_ids.append(self._pending)
        self._pending = []
        self.events.append(("end_step", global_step))

    def on_end_train_epoch(self, global_step, epoch):
        self.events.append(("end_epoch", global_step, epoch))

    def on_end_train(self, global_step):
        self.events.append(("end_train", global_step))


def args(tmp_path, **kw) -> TrainerArguments:
    base = dict(epochs=1, train_batch_size=10, micro_batch_size=10, output_dir=str(tmp_path),
                writers=["jsonl"], log_every_n_steps=1, seed=0)
    base.update(kw)
    return TrainerArguments(**base)


def local_bytes(tensor) -> int:
    """Bytes this process holds of ``tensor`` (its own shard of a DTensor)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


class WideRecipe(LinearRecipe):
    """LinearRecipe with a hidden layer, so that sharding has rows to split, and a count
    of the gradient bytes this process holds after each step's backward."""

    def __init__(self, data: IdData, dim: int = 4, hidden: int = 32, **kw) -> None:
        super().__init__(data, dim=dim, **kw)
        torch.manual_seed(0)
        self.hidden = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh())
        self.linear = nn.Linear(hidden, 1)
        self.grad_bytes = 0

    def forward(self, x):
        return self.linear(self.hidden(self.dropout(x))).squeeze(-1)

    def on_end_backward(self, global_step, loss):
        super().on_end_backward(global_step, loss)
        self.grad_bytes = sum(local_bytes(p.grad) for p in self.parameters()
                              if p.grad is not None)


class SlowBuildRecipe(LinearRecipe):
    """A recipe whose construction takes ``seconds`` (a large model being built) on
    ``only_rank`` (every rank when -1); it touches the file named by $SLOW_BUILD_MARKER
    when it starts, so that a test can signal it during set-up."""

    def __init__(self, data: IdData, seconds: float = 30.0, only_rank: int = -1, **kw) -> None:
        import os
        import time

        super().__init__(data, **kw)
        if only_rank >= 0 and os.environ.get("RANK", "0") != str(only_rank):
            return  # the other ranks go on and wait for this one in the process group
        marker = os.environ.get("SLOW_BUILD_MARKER")
        if marker:
            open(marker, "w").close()
        time.sleep(seconds)
