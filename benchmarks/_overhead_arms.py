"""The variants overhead.py times and counts: the hand-written loops, sailfin's Trainer on
the same data (in this process, or from another tree in a child process for
``--against``), and the other trainers of ``_peers.py``. Each returns seconds per step
(steady, end to end) and the final weights' fingerprint."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import torch
from torch import nn

from _against import run_child as against_child
from _hand import (BATCH, batched_loader, direct_batches, fingerprint, make_data,
                   make_model, per_sample_loader, synchronize)
from _peers import PEERS
from sailfin import Callback, DataInterface, ModuleInterface, Trainer, TrainerArguments
from sailfin.config import CheckpointArguments, EmaArguments
from sailfin.config.distributed import DistArguments

OVERHEAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "overhead.py")
LOG_EVERY = 10
REFERENCE = "hand-per-sample"  # the hand loop over the standard DataLoader
LOADERS: dict[str, Callable[[Any], Any]] = {
    "hand": batched_loader, "hand-per-sample": per_sample_loader, "hand-direct": direct_batches}


# -- the hand-written loop -----------------------------------------------------------------
def run_hand(ds, fetch: str = "hand", device: str = "cpu") -> tuple[float, float, float]:
    """Seconds per step (steady, end to end) and the final weights' fingerprint."""
    begin = time.perf_counter()
    model = make_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = LOADERS[fetch](ds)
    start = time.perf_counter()
    step = 0
    for step, (x, y) in enumerate(batches, 1):
        loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % LOG_EVERY == 0:
            print(f"step {step} loss {loss.item():.4f}")
    synchronize(device)
    end = time.perf_counter()
    return (end - start) / step, (end - begin) / step, fingerprint(model)


# -- sailfin -------------------------------------------------------------------------------
class Data(DataInterface):
    def __init__(self, ds):
        self.ds = ds

    def get_train_dataset(self):
        return self.ds


class PerSample(torch.utils.data.Dataset):
    """The same samples as a ``TensorDataset``, of a type sailfin does not gather: its
    loader is the standard ``DataLoader`` (``dataset[i]`` per sample, ``default_collate``)."""

    def __init__(self, ds):
        self.tensors = ds.tensors

    def __len__(self):
        return len(self.tensors[0])

    def __getitem__(self, i):
        return tuple(t[i] for t in self.tensors)


class Recipe(ModuleInterface):
    def __init__(self, data):
        super().__init__()
        self.data = data
        self.net = make_model()

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [torch.optim.SGD(self.parameters(), lr=0.01)], []

    def train_step(self, global_step, batch, device):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x.to(device)), y.to(device))


class LastStep(Callback):
    """When the last optimizer step ended (the steady clock's stop)."""

    at = 0.0

    def __init__(self, last_step: int, device: str = "cpu") -> None:
        self.last_step, self.device = last_step, device

    def on_step_end(self, trainer):
        if trainer.global_step == self.last_step:  # as the hand loop: wait for the device once
            synchronize(self.device)
        self.at = time.perf_counter()


def run_sailfin(ds, out_dir, ema: Optional[float] = None, hang_seconds: Optional[float] = None,
                device: str = "cpu") -> tuple[float, float, float]:
    """Seconds per step (steady, end to end) and the final weights' fingerprint."""
    begin = time.perf_counter()
    module = Recipe(Data(ds))
    args = TrainerArguments(epochs=1, train_batch_size=BATCH, log_every_n_steps=LOG_EVERY,
                            output_dir=out_dir, val_every_n_epochs=0,
                            ema=EmaArguments(decay=ema),  # decay None: off
                            # no checkpoints, as Lightning's enable_checkpointing=False
                            checkpoint=CheckpointArguments(at_epoch_end=False),
                            distributed=DistArguments(hang_seconds=hang_seconds), device=device)
    last = LastStep(len(ds) // BATCH, device)
    trainer = Trainer(module, args, callbacks=[last])
    trainer.setup()
    start = time.perf_counter()
    steps = trainer.train()["global_step"]
    end = time.perf_counter()
    return (last.at - start) / steps, (end - begin) / steps, fingerprint(module.net)


def run_variant(name: str, ds, out_dir: str, opts: argparse.Namespace) -> tuple[float, ...]:
    device = opts.device
    if name in LOADERS:
        return run_hand(ds, name, device)
    if name == "sailfin":
        return run_sailfin(ds, out_dir, device=device)
    if name == "sailfin-per-sample":  # the standard DataLoader's fetch, as hand-per-sample's
        return run_sailfin(PerSample(ds), out_dir, device=device)
    if name in opts.trees:  # a sailfin from a checked-out tree, in a process of its own
        got = against_child([sys.executable, OVERHEAD, "--child-time",
                             "sailfin", str(len(ds) // BATCH), "--threads", str(opts.threads),
                             "--device", device], opts.trees[name])
        return got["steady"], got["whole"], got["weights"]
    if name == "sailfin+ema":
        return run_sailfin(ds, out_dir, ema=opts.ema, device=device)
    if name == "sailfin+watchdog":  # the same trainer with the watchdog's thread running
        return run_sailfin(ds, out_dir, hang_seconds=opts.watchdog, device=device)
    steady, whole = PEERS[name][1](make_model, batched_loader(ds), out_dir, LOG_EVERY, device)
    return steady, whole, float("nan")


def run_child(variant: str, steps: int, opts: argparse.Namespace) -> tuple[float, ...]:
    ds = make_data(steps)
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        return run_variant(variant, ds, tmp, opts)
