"""Strategy: where a step runs and how gradients are combined.

The trainer owns the loop and calls these methods; a strategy never loops.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from ..distributed import DistEnv
from .precision import Precision


class SingleDevice:
    """One process, one device. Holds a :class:`Precision` and forwards to it.

    Example::

        backend = SingleDevice(Precision(), torch.device("cpu"))
        backend.setup(module)
        out = backend.train_step(module, step, batch, sync=True)
    """

    strategy = "single"

    def __init__(self, precision: Precision, device: torch.device,
                 dist: Optional[DistEnv] = None) -> None:
        self.precision = precision
        self.device = device
        self.dist = dist or DistEnv()

    @property
    def name(self) -> str:
        return f"{self.strategy}+{self.precision.name}"

    # -- set-up -------------------------------------------------------------
    def setup(self, module: torch.nn.Module) -> None:
        module.to(self.device)
        self._train_step = module.train_step
        self._val_step = module.val_step
        if type(self.precision).forward_context is Precision.forward_context:
            self.train_step = self._train_step_plain  # fp32: no autocast to enter per step

    def _train_step_plain(self, module: torch.nn.Module, global_step: int, batch: Any,
                          sync: bool = True) -> Any:
        return self._train_step(global_step, batch, self.device)

    def teardown(self) -> None:
        pass

    # -- one step -------------------------------------------------------------
    def train_step(self, module: torch.nn.Module, global_step: int, batch: Any,
                   sync: bool = True) -> Any:
        """Run the recipe's ``train_step``. ``sync=False``: gradients stay local."""
        with self.precision.forward_context():
            return self._train_step(global_step, batch, self.device)

    def val_step(self, module: torch.nn.Module, global_step: int, batch: Any) -> Any:
        with self.precision.forward_context():
            return self._val_step(global_step, batch, self.device)

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.backward(loss)

    def clip_grad_norm(self, parameters: Iterable[torch.nn.Parameter],
                       optimizers: list[torch.optim.Optimizer], max_norm: float
                       ) -> torch.Tensor:
        for opt in optimizers:
            self.precision.unscale_gradients(opt)  # clip true gradients, not scaled ones
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def optimizer_step(self, optimizers: list[torch.optim.Optimizer]) -> bool:
        """Step every optimizer; False when the precision skipped the step."""
        stepped = True
        for opt in optimizers:
            stepped = self.precision.optimizer_step(opt) and stepped
        self.precision.update()
        return stepped

    # -- collectives (trivial on one process) ------------------------------------
    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather_outputs(self, outputs: list[Any]) -> list[Any]:
        """Every rank's validation outputs, in rank order (one rank: its own)."""
        return outputs

    def barrier(self) -> None:
        pass

    # -- checkpoint state -------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"precision": self.precision.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.precision.load_state_dict(state.get("precision", {}))
