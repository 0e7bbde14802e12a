"""``trainer.ema``: an exponential moving average of the weights, kept on their device.

After every ``every_n_steps``-th optimizer step, ``ema = decay * ema + (1 - decay) * w``,
starting from the weights the run began with: one fused lerp
(``sailfin.compat.torch.lerp_all_``) whatever the parameters are (plain, DDP's, equal on
every rank, or fsdp shards, each rank averaging its own)."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional

import torch

from ...compat.torch import lerp_all_
from ...config.loop import EmaArguments
from ...utils.voice import say
from ..core.callbacks import Callback

if TYPE_CHECKING:
    from ..core.view import RunView


class WeightAverage(Callback):
    """Keeps the average of ``module``'s parameters; a callback of the trainer.

    Example::

        ema = WeightAverage(module, EmaArguments(decay=0.999))
        Trainer(module, args, callbacks=[ema]).train()   # the trainer adds one from args.ema
        with ema.swapped_in(module):
            evaluate(module)                              # the averaged weights
    """

    state_key = "ema"
    state_in_dcp = True  # the averages have the parameters' shapes

    def __init__(self, module: torch.nn.Module, args: EmaArguments) -> None:
        if args.decay is None:
            raise ValueError("WeightAverage needs EmaArguments.decay (e.g. 0.999)")
        self.args = args
        self.decay = float(args.decay)
        self.every = args.every_n_steps
        named = list(module.named_parameters())
        self.names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self.shadow = [p.detach().clone() for p in self._params]
        # Integer parameters (rare) are not averaged: they stay as they started.
        floats = [i for i, p in enumerate(self._params) if p.is_floating_point()]
        self._lerp_shadow = [self.shadow[i] for i in floats]
        self._lerp_params = [self._params[i] for i in floats]
        self.updates = 0  # averaging steps done (the warm-up's n)
        self._restored = False

    def on_train_start(self, trainer: "RunView") -> None:
        if not self._restored:
            # The average starts from the weights training starts from: those trainer.init_from
            # loaded, or a checkpoint's saved without trainer.ema, not the fresh model's.
            _copy(self.shadow, self._params)
            if trainer.global_step and trainer.dist.is_main:
                say("trainer.ema: the checkpoint holds no average; it starts from the "
                    f"resumed weights at step {trainer.global_step}")

    # -- the average ---------------------------------------------------------------
    def on_step_end(self, trainer: "RunView") -> None:
        if trainer.global_step % self.every == 0:
            self.update()

    @torch.no_grad()
    def update(self) -> None:
        """ema += (1 - decay) * (w - ema): one fused op over every parameter (with warm-up,
        the n-th update's decay is min(decay, (1 + n) / (10 + n)))."""
        decay = self.decay
        if self.args.warmup:
            decay = min(decay, (1 + self.updates) / (10 + self.updates))
        if self._lerp_shadow:
            lerp_all_(self._lerp_shadow, self._lerp_params, 1.0 - decay)
        self.updates += 1

    # -- using the averaged weights --------------------------------------------------
    @contextlib.contextmanager
    def swapped_in(self, module: torch.nn.Module) -> Iterator[None]:
        """The averaged weights in ``module`` inside the block; the trained ones after,
        whatever happens inside. Costs one extra copy of the weights meanwhile."""
        saved = [p.detach().clone() for p in self._params]
        _copy(self._params, self.shadow)
        try:
            yield
        finally:
            _copy(self._params, saved)

    def save_final(self, module: torch.nn.Module, output_dir: str,
                   save: Callable[[torch.nn.Module, str, bool], Optional[str]],
                   write: bool) -> Optional[str]:
        """``<output_dir>/final/ema.safetensors``: the averaged weights under the names of
        ``final/model.safetensors`` (buffers are the model's), saved by every rank with the
        backend's ``save_final_weights`` (under fsdp a collective); ``write``: this rank
        writes the file."""
        with self.swapped_in(module):  # the live (swapped-in) tensors are saved
            return save(module, os.path.join(output_dir, "final", "ema.safetensors"), write)

    # -- carried in the checkpoint ------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # Under fsdp the averages are DTensor shards: the checkpoint writes them with the
        # model's shards (DCP), each rank its own rows; a resume re-cuts them.
        return {"decay": self.decay, "updates": self.updates,
                "shadow": dict(zip(self.names, self.shadow))}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state["shadow"]
        missing = [n for n in self.names if n not in saved]
        if missing:
            raise ValueError(f"the checkpoint's EMA weights lack {', '.join(missing[:5])}"
                             f"{' ...' if len(missing) > 5 else ''} (trainer.ema)")
        _copy(self.shadow, [_like(saved[n], t) for n, t in zip(self.names, self.shadow)])
        self.updates = int(state["updates"])
        self._restored = True


@torch.no_grad()
def _copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i] = src[i]`` in place. One copy per tensor (rare: validation, resume), as
    sharded tensor types support ``copy_`` more widely than the foreach copy."""
    for d, s in zip(dst, src):
        d.copy_(s)


def _like(saved: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
    """``saved`` (a full tensor) cut as ``mine`` is: this rank's shard under fsdp, on any
    world size; a plain tensor as it is."""
    mesh = getattr(mine, "device_mesh", None)
    if mesh is None or hasattr(saved, "device_mesh"):
        return saved  # a plain tensor, or shards DCP already cut for this rank
    from torch.distributed.tensor import distribute_tensor

    # Every rank read the same file: each takes its own piece, no communication.
    return distribute_tensor(saved.to(mine.device), mesh, mine.placements, src_data_rank=None)
