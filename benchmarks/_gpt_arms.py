"""The ways benchmarks/gpt.py trains its model, each as an arm whose ``run(steps)`` trains
that many more steps and returns the seconds they took: the hand loop (nanoGPT's
``train.py`` way), sailfin's Trainer, and the same hand loop through Lightning Fabric and
Accelerate.

    arm = Hand(GPT2, tokens(GPT2, 64), torch.device("cuda")); arm.run(10)
"""

from __future__ import annotations

import contextlib
import io
import time
from typing import Any, Optional

import torch
from torch import nn

from _gpt_model import GPTRecipe, Shape, make_gpt, optimizer
from _hand import batched_loader

from sailfin import Trainer, TrainerArguments
from sailfin.config import CheckpointArguments
from sailfin.config.fsdp import FSDPArguments


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Hand:
    """nanoGPT's ``train.py`` loop over the same loader: loss / accumulation, backward per
    micro-batch, clip, step, ``zero_grad(set_to_none=True)``, ``loss.item()`` at the end.
    Fabric and Accelerate run the same loop through their own backward and clipping."""

    def __init__(self, s: Shape, ds, device: torch.device, compiled: bool = False) -> None:
        self.s, self.device = s, device
        self.model = make_gpt(s).to(device)
        self.opt = optimizer(self.model, device.type == "cuda")
        self.forward = torch.compile(self.model) if compiled else self.model
        self.batches = iter(batched_loader(ds, batch=s.micro))
        self.ctx: Any = torch.autocast(device.type, dtype=torch.bfloat16)

    def weights(self) -> nn.Module:
        return self.model

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)

    def run(self, steps: int) -> float:
        synchronize(self.device)
        begin = time.perf_counter()
        for _ in range(steps):
            for _ in range(self.s.accumulation):
                x, y = next(self.batches)
                with self.ctx:
                    loss = self.forward(x.to(self.device), y.to(self.device))
                self.backward(loss / self.s.accumulation)
            self.clip()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        loss.item()  # the loss the loop logs at its end: waits for the GPU
        synchronize(self.device)
        return time.perf_counter() - begin


class Sailfin:
    """sailfin's Trainer on the same recipe, a few steps per call (``max_steps`` raised)."""

    def __init__(self, s: Shape, ds, device: torch.device, out: str,
                 callbacks: Optional[list] = None, **keys: Any) -> None:
        self.module = GPTRecipe(s, ds, device.type == "cuda")
        if "checkpoint" in keys:
            keys["checkpoint"] = CheckpointArguments(**keys["checkpoint"])
        if "fsdp" in keys:
            keys["fsdp"] = FSDPArguments(**keys["fsdp"])
        args = TrainerArguments(epochs=1, max_steps=1, train_batch_size=s.micro * s.accumulation,
                                micro_batch_size=s.micro, drop_last=True, max_grad_norm=1.0,
                                val_every_n_epochs=0, log_every_n_steps=10**6, output_dir=out,
                                device=str(device), seed=42, writers=[], resume="never",
                                progress="none", **keys)
        self.trainer = Trainer(self.module, args, callbacks=callbacks or [])
        self.device = device

    def weights(self) -> nn.Module:
        return self.module.gpt

    def run(self, steps: int) -> float:
        """The seconds of the loop itself (``train_seconds``: its clock stops after the check
        of the last loss, which waits for the GPU), not ``train()``'s start and end, which a
        run pays once and this benchmark, calling ``train()`` once per round, every round."""
        t = self.trainer
        t.args.max_steps = t.global_step + steps
        before = t.train_seconds
        with contextlib.redirect_stdout(io.StringIO()):
            t.train()
        return t.train_seconds - before


class Fabric(Hand):
    """The same loop through Lightning Fabric (``bf16-mixed``: its own autocast)."""

    def __init__(self, s: Shape, ds, device: torch.device) -> None:
        from lightning.fabric import Fabric as LightningFabric

        self.s, self.device, self.ctx = s, device, contextlib.nullcontext()
        self.fabric = LightningFabric(accelerator="gpu" if device.type == "cuda" else "cpu",
                                      devices=1, precision="bf16-mixed")
        model = make_gpt(s)
        self.model, self.opt = self.fabric.setup(model, optimizer(model, device.type == "cuda"))
        self.forward = self.model
        self.batches = iter(batched_loader(ds, batch=s.micro))

    def weights(self) -> nn.Module:
        return self.model.module if hasattr(self.model, "module") else self.model

    def backward(self, loss: torch.Tensor) -> None:
        self.fabric.backward(loss)

    def clip(self) -> None:
        self.fabric.clip_gradients(self.model, self.opt, max_norm=1.0)


class Accelerate(Hand):
    """The same loop through Accelerate (``mixed_precision="bf16"``: its own autocast)."""

    def __init__(self, s: Shape, ds, device: torch.device) -> None:
        from accelerate import Accelerator

        self.s, self.device, self.ctx = s, device, contextlib.nullcontext()
        self.acc = Accelerator(cpu=device.type == "cpu", mixed_precision="bf16")
        model = make_gpt(s)
        self.model, self.opt = self.acc.prepare(model, optimizer(model, device.type == "cuda"))
        self.forward = self.model
        self.batches = iter(batched_loader(ds, batch=s.micro))

    def weights(self) -> nn.Module:
        return self.acc.unwrap_model(self.model)

    def backward(self, loss: torch.Tensor) -> None:
        self.acc.backward(loss)

    def clip(self) -> None:
        self.acc.clip_grad_norm_(self.model.parameters(), 1.0)
