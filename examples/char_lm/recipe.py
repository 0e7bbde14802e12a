"""A small GPT-style character language model on Python's own source code.

The corpus is the standard library's ``.py`` files, read at run time from
this interpreter's installation: offline, a few megabytes of real text. Text
is modelled byte by byte (256 symbols), so nothing needs a vocabulary file.

    sailfin train examples/char_lm/config.yaml
    sailfin train examples/char_lm/config.yaml --trainer.backend sp-amp --trainer.compile true
"""

from __future__ import annotations

import math
import os
import sysconfig

import torch
from torch import nn
from torch.nn import functional as F

from sailfin import DataInterface, ModuleInterface

VOCAB = 256  # bytes


def read_stdlib(max_bytes: int) -> bytes:
    """Up to ``max_bytes`` of the standard library's source, files in sorted path order."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages",
                                                      "__pycache__", "test", "idlelib"))
        paths += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    chunks, size = [], 0
    for path in sorted(paths):
        with open(path, "rb") as fh:
            data = fh.read(max_bytes - size)
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    if size < 10_000:
        raise RuntimeError(f"found only {size} bytes of Python source under {root}; the "
                           "char_lm example reads the standard library's .py files")
    return b"".join(chunks)


class Windows(torch.utils.data.Dataset):
    """Windows of ``context + 1`` bytes starting every ``stride`` bytes: (input, target)."""

    def __init__(self, data: torch.Tensor, context: int, stride: int) -> None:
        self.data, self.context, self.stride = data, context, stride
        self.n = (len(data) - context - 1) // stride + 1

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        chunk = self.data[i * self.stride: i * self.stride + self.context + 1]
        return chunk[:-1], chunk[1:]


class StdlibText(DataInterface):
    """The first ``max_bytes`` of the standard library's source; the last ``val_fraction``
    is held out for validation."""

    def __init__(self, context: int = 128, max_bytes: int = 2_000_000, stride: int = 64,
                 val_fraction: float = 0.05) -> None:
        raw = read_stdlib(max_bytes)
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
        split = int(len(data) * (1 - val_fraction))
        self.context = context
        self.train = Windows(data[:split], context, stride)
        self.val = Windows(data[split:], context, context)  # no overlap: each byte once

    def get_train_dataset(self):
        return self.train

    def get_val_dataset(self):
        return self.val


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block: attention then MLP, each with a residual."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharLM(ModuleInterface):
    """GPT-style decoder over bytes: embeddings, ``layers`` blocks, a tied output head."""

    def __init__(self, data: StdlibText | None = None, context: int = 128, layers: int = 4,
                 dim: int = 128, heads: int = 4, dropout: float = 0.0, lr: float = 1e-3,
                 weight_decay: float = 0.01, warmup_steps: int = 20) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"module.init_args.dim={dim} must be a multiple of heads={heads}")
        self.data = data
        self.context = context
        self.lr, self.weight_decay, self.warmup_steps = lr, weight_decay, warmup_steps
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied input/output embeddings
        self.apply(_init)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        total = max(1, estimated_global_steps_per_epoch * epochs)
        warmup = max(1, min(self.warmup_steps, total // 2))

        def schedule(step: int) -> float:  # linear warm-up, then cosine decay to 10 %
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

        return [opt], [torch.optim.lr_scheduler.LambdaLR(opt, schedule)]

    def train_step(self, global_step, batch, device):
        x, y = batch[0].to(device), batch[1].to(device)
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))

    def val_step(self, global_step, batch, device):
        x, y = batch[0].to(device), batch[1].to(device)
        logits = self(x).float()
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="none")
        return {"loss": loss.view(len(x), -1).mean(1)}

    def on_end_val_epoch(self, global_step, outputs, key="val"):
        loss = outputs["loss"].mean().item()
        return {"loss": loss, "bits_per_byte": loss / math.log(2)}

    @torch.no_grad()
    def generate(self, prompt: bytes, length: int, temperature: float = 0.8,
                 seed: int = 0) -> bytes:
        """Continue ``prompt`` by ``length`` bytes, sampling at ``temperature``."""
        g = torch.Generator().manual_seed(seed)
        device = self.tok.weight.device
        idx = torch.tensor([list(prompt)], dtype=torch.long, device=device)
        for _ in range(length):
            logits = self(idx[:, -self.context:])[0, -1].float().cpu() / temperature
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)
            idx = torch.cat([idx, nxt.to(device).view(1, 1)], dim=1)
        return bytes(idx[0, len(prompt):].tolist())


def _init(m: nn.Module) -> None:
    # GPT-2's initialisation: small weights keep the first logits (and loss) near uniform.
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)
