"""Precision: how forward, backward and the optimizer step treat number formats
(docs/backends.md). The fp32 base does nothing special; :class:`MixedPrecision`
overrides only what it changes: autocast around the step, and for float16 loss scaling.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

from ..compat.torch import found_inf_per_device
from ..config.errors import ConfigError

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


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def default_amp_dtype(device: torch.device) -> str:
    """bfloat16 where the device runs it (CPU, CUDA from Ampere on), else float16."""
    bf16 = torch.cuda.is_bf16_supported() if device.type == "cuda" else device.type == "cpu"
    return "bfloat16" if bf16 else "float16"


class MixedPrecision(Precision):
    """Autocast to ``dtype`` on ``device``; float16 adds a :class:`torch.amp.GradScaler`.

    Example::

        precision = MixedPrecision("bfloat16", torch.device("cpu"))
        with precision.forward_context():
            loss = model.train_step(step, batch, device)
        precision.backward(loss)
        precision.optimizer_step(optimizer)
        precision.update()
    """

    def __init__(self, dtype: str, device: torch.device) -> None:
        if dtype == "auto":
            dtype = default_amp_dtype(device)
        if dtype not in _DTYPES:
            raise ConfigError(f"trainer.amp_dtype {dtype!r} is not supported; use "
                              f"{' or '.join(_DTYPES)}")
        if not torch.amp.is_autocast_available(device.type):
            raise ConfigError(f"mixed precision needs autocast, which device type "
                              f"{device.type!r} does not have; use trainer.backend sp")
        if dtype == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError(f"trainer.amp_dtype bfloat16: {torch.cuda.get_device_name(device)} "
                              "does not support bfloat16; use trainer.amp_dtype float16")
        self.dtype = _DTYPES[dtype]
        self.device_type = device.type
        self.name = "bf16" if self.dtype is torch.bfloat16 else "fp16"
        # Loss scaling only for float16; bfloat16 has float32's range.
        self.scaler = torch.amp.GradScaler(device.type) if dtype == "float16" else None
        self._unscaled: set[int] = set()

    def forward_context(self) -> ContextManager:
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None and id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)  # once per step: GradScaler refuses a second time
            self._unscaled.add(id(optimizer))

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        if self.scaler is None:
            optimizer.step()
            return True
        self.unscale_gradients(optimizer)
        self.scaler.step(optimizer)  # skips optimizer.step() when gradients hold inf/NaN
        # step() has already read these flags to the host: no further sync here.
        found_inf = found_inf_per_device(self.scaler, optimizer)  # private: see compat/torch.py
        return not any(bool(v.item()) for v in found_inf.values())

    def update(self) -> None:
        if self.scaler is not None:
            self.scaler.update()  # halve the scale after a skipped step, grow it when stable
            self._unscaled.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
