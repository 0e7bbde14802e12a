"""The model benchmarks/gpt.py trains: a nanoGPT-style decoder written here (GPT-2 small's
shape by default), its AdamW, its FLOPs per token, generated tokens, and the sailfin recipe
around the same model.

    from _gpt_model import GPT2, make_gpt, tokens
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from sailfin import DataInterface, ModuleInterface


@dataclass(frozen=True)
class Shape:
    layers: int = 12
    dim: int = 768
    heads: int = 12
    context: int = 1024
    vocab: int = 50304  # GPT-2's 50,257 rounded up to a multiple of 64
    micro: int = 16
    accumulation: int = 4


GPT2 = Shape()
TINY = Shape(layers=2, dim=64, heads=4, context=64, vocab=512, micro=4, accumulation=2)


# -- the model: a nanoGPT-style decoder ------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.heads = s.heads
        self.qkv = nn.Linear(s.dim, 3 * s.dim)
        self.proj = nn.Linear(s.dim, s.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, d))


class Block(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(s.dim), nn.LayerNorm(s.dim)
        self.attn = Attention(s)
        self.fc = nn.Linear(s.dim, 4 * s.dim)
        self.out = nn.Linear(4 * s.dim, s.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.shape = s
        self.wte = nn.Embedding(s.vocab, s.dim)
        self.wpe = nn.Embedding(s.context, s.dim)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.ln_f = nn.LayerNorm(s.dim)
        self.lm_head = nn.Linear(s.dim, s.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2's init; residual projections scaled by depth
                std = 0.02 / math.sqrt(2 * s.layers) if name.endswith(("proj.weight",
                                                                       "out.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))


def make_gpt(s: Shape) -> GPT:
    torch.manual_seed(0)
    return GPT(s)


def optimizer(model: nn.Module, fused: bool) -> torch.optim.Optimizer:
    """nanoGPT's AdamW: decay on the matrices and embeddings, none on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), **({"fused": True} if fused
                                                                    else {}))


def flops_per_token(s: Shape) -> float:
    n = sum(p.numel() for p in make_gpt_meta(s).parameters()) - s.context * s.dim
    return 6 * n + 12 * s.layers * s.dim * s.context


def make_gpt_meta(s: Shape) -> GPT:
    with torch.device("meta"):
        return GPT(s)


def tokens(s: Shape, sequences: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, s.vocab, (sequences, s.context + 1), generator=g)
    return torch.utils.data.TensorDataset(data[:, :-1].contiguous(), data[:, 1:].contiguous())


# -- sailfin's recipe around the same model ----------------------------------------------------
class Tokens(DataInterface):
    def __init__(self, ds: torch.utils.data.TensorDataset) -> None:
        self.ds = ds

    def get_train_dataset(self):
        return self.ds


class GPTRecipe(ModuleInterface):
    def __init__(self, s: Shape, ds: torch.utils.data.TensorDataset, fused: bool) -> None:
        super().__init__()
        self.data, self.fused = Tokens(ds), fused
        self.gpt = make_gpt(s)

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [optimizer(self, self.fused)], []

    def train_step(self, global_step, batch, device):
        return self.gpt(batch[0].to(device), batch[1].to(device))
