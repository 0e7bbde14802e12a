"""Models written the way their users write them, as sailfin recipes, for the zoo test.

``GPT`` is nanoGPT's layout: blocks in a ``ModuleList``, the token embedding tied to the
output head, ``self.apply`` initialisation with GPT-2's scaled residual projections, and a
causal mask kept as a non-persistent buffer. ``ConvNext`` is a vision model: PyPI's
``timm`` needs ``torchvision``, whose wheel does not import beside the torch CPU wheel this
project tests with, so the vision model is transformers' ConvNeXt built from a config
(LayerNorm, layer scale, stages of blocks).

Every recipe trains with AdamW and a schedule whose first step has learning rate 0, so the
weights after step 1 are the weights each backend started from.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from sailfin import DataInterface, ModuleInterface


def first_step_at_lr_0(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0 if step == 0 else 1.0)


class Tokens(DataInterface):
    """Random token windows (a fixed generator: the same on every rank)."""

    def __init__(self, n: int = 64, context: int = 16, vocab: int = 61) -> None:
        g = torch.Generator().manual_seed(3)
        self.data = torch.randint(0, vocab, (n, context + 1), generator=g)

    def get_train_dataset(self):
        return torch.utils.data.TensorDataset(self.data[:, :-1], self.data[:, 1:])

    def get_val_dataset(self):
        return None


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, context: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        # nanoGPT's mask: a buffer, not a parameter, and not saved with the weights.
        self.register_buffer("bias", torch.tril(torch.ones(context, context))
                             .view(1, 1, context, context), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, context: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, context)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(ModuleInterface):
    def __init__(self, data: Tokens, layers: int = 3, dim: int = 32, heads: int = 2,
                 context: int = 16, vocab: int = 61, lr: float = 1e-2) -> None:
        super().__init__()
        self.data, self.lr = data, lr
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(context, dim)
        self.h = nn.ModuleList(Block(dim, heads, context) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT writes it
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        return [opt], [first_step_at_lr_0(opt)]

    def train_step(self, global_step, batch, device):
        x, y = batch[0].to(device), batch[1].to(device)
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def val_step(self, global_step, batch, device):
        return {}


class Images(DataInterface):
    """Random 32 x 32 images with one of 5 labels."""

    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(4)
        self.x = torch.randn(n, 3, 32, 32, generator=g)
        self.y = torch.randint(0, 5, (n,), generator=g)

    def get_train_dataset(self):
        return torch.utils.data.TensorDataset(self.x, self.y)

    def get_val_dataset(self):
        return None


class ConvNext(ModuleInterface):
    def __init__(self, data: Images, lr: float = 1e-3) -> None:
        super().__init__()
        import transformers

        self.data, self.lr = data, lr
        cfg = transformers.ConvNextConfig(num_channels=3, patch_size=4, hidden_sizes=[8, 16], num_stages=2,
                                          depths=[2, 2], num_labels=5, image_size=32)
        self.model = transformers.ConvNextForImageClassification(cfg)

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        return [opt], [first_step_at_lr_0(opt)]

    def train_step(self, global_step, batch, device):
        return self.model(pixel_values=batch[0].to(device), labels=batch[1].to(device)).loss

    def val_step(self, global_step, batch, device):
        return {}
