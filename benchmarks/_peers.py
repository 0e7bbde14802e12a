"""Other trainers around the same model and the same batched loader, for overhead.py.

Each takes ``(make_model, loader, out_dir, log_every, device)`` and returns seconds
per step ``(steady, end to end)``; ``device`` is ``"cpu"`` or ``"cuda"``, where each
moves the batches itself (as its users do) and the clock stops after the device's
queued work; the loader is the one the hand loop uses (whole
batches fetched by index, as sailfin's), so only the trainer differs.
Lightning's Trainer does its set-up inside ``fit``: end to end only.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn

from _hand import synchronize


def _lightning(device: str) -> str:
    return "gpu" if device.startswith("cuda") else "cpu"


def run_lightning(make_model: Callable[[], nn.Module], loader: Any, out_dir: str,
                  log_every: int, device: str = "cpu") -> tuple[float, float]:
    import lightning as L

    class LitModel(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    begin = time.perf_counter()
    trainer = L.Trainer(max_epochs=1, accelerator=_lightning(device), devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=log_every,
                        default_root_dir=out_dir)
    trainer.fit(LitModel(), loader)
    synchronize(device)
    per_step = (time.perf_counter() - begin) / len(loader)
    return per_step, per_step


def run_fabric(make_model: Callable[[], nn.Module], loader: Any, out_dir: str,
               log_every: int, device: str = "cpu") -> tuple[float, float]:
    from lightning.fabric import Fabric

    begin = time.perf_counter()
    fabric = Fabric(accelerator=_lightning(device), devices=1)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(loader)
    start = time.perf_counter()
    steps = 0
    for steps, (x, y) in enumerate(loader, 1):
        loss = nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if steps % log_every == 0:
            print(f"step {steps} loss {loss.item():.4f}")
    synchronize(device)
    end = time.perf_counter()
    return (end - start) / steps, (end - begin) / steps


def run_accelerate(make_model: Callable[[], nn.Module], loader: Any, out_dir: str,
                   log_every: int, device: str = "cpu") -> tuple[float, float]:
    from accelerate import Accelerator

    begin = time.perf_counter()
    accelerator = Accelerator(cpu=device == "cpu")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    start = time.perf_counter()
    steps = 0
    for steps, (x, y) in enumerate(loader, 1):
        loss = nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if steps % log_every == 0:
            print(f"step {steps} loss {loss.item():.4f}")
    synchronize(device)
    end = time.perf_counter()
    return (end - start) / steps, (end - begin) / steps


# name -> (the package that must be installed, the runner)
PEERS = {"lightning": ("lightning", run_lightning), "fabric": ("lightning", run_fabric),
         "accelerate": ("accelerate", run_accelerate)}
