"""Precision: how forward, backward and the optimizer step treat number formats.

The fp32 base does nothing special; mixed-precision variants override only
what they change.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

_NULL = contextlib.nullcontext()


class Precision:
    """Full fp32: no autocast, no loss scaling."""

    name = "fp32"

    def forward_context(self) -> ContextManager:
        return _NULL

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``.grad`` hold true gradients (before clipping)."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step; return False when the step was skipped (non-finite gradients)."""
        optimizer.step()
        return True

    def update(self) -> None:
        """Called once after all optimizers stepped (loss-scale bookkeeping)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
