"""The workload of ``fsdp_memory.py``: a GPT-style transformer recipe on random tokens,
each block a ``TransformerEncoderLayer`` in a ``ModuleList`` (fsdp's units), and a clock
of optimizer steps."""

from __future__ import annotations

import time

import torch
from torch import nn

from sailfin import Callback, DataInterface, ModuleInterface

SEQ, VOCAB = 32, 10_000


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


class Tokens(DataInterface):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ds = torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (n, SEQ + 1),
                                                               generator=g))

    def get_train_dataset(self):
        return self.ds


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(dim, 8, 4 * dim, dropout=0.0,
                                                batch_first=True, norm_first=True)

    def forward(self, h, mask):
        return self.layer(h, src_mask=mask, is_causal=True)


class GPT(ModuleInterface):
    def __init__(self, data: Tokens, layers: int, width: int) -> None:
        super().__init__()
        self.data = data
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ))
        self.grad_bytes = 0

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [torch.optim.AdamW(self.parameters(), lr=1e-4)], []

    def train_step(self, global_step, batch, device):
        tokens = batch[0].to(device)
        h = self.embed(tokens[:, :-1])
        for block in self.blocks:
            h = block(h, self.mask)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), tokens[:, 1:].flatten())

    def on_end_backward(self, global_step, loss):
        self.grad_bytes = sum(local_bytes(p.grad) for p in self.parameters()
                              if p.grad is not None)


class StepClock(Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._last = None

    def on_step_end(self, trainer) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now
