"""What a checkpoint holds of the trainer, and putting it back.

With ``ModuleInterface.checkpoint_frozen_params = False`` (LoRA through ``peft:``),
checkpoints hold only the parameters that train and a fingerprint of the frozen base
(per parameter: name, shape, dtype and a checksum of its bytes: ``frozen_base``), checked
on resume and on ``init_from``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import torch

from .frozen_base import fingerprint, frozen_names, mismatch
from ...backends.state import dcp_optimizer_state

if TYPE_CHECKING:
    from ..core.callbacks import Callback
    from ..core.view import RunView

# The trainer's counters, as trainer.pt holds them.
COUNTERS = ("global_step", "epoch", "step_in_epoch", "samples_seen", "train_seconds",
            "last_val_step")


def trainer_state(trainer: "RunView", named_optimizers: bool = False) -> dict[str, Any]:
    """Every stateful piece but the random streams (per rank: ``checkpoint.rng``);
    ``named_optimizers``: the optimizers' state keyed by parameter name, as a checkpoint
    holds it on every backend."""
    backend, module = trainer.backend, trainer.module
    model = backend.model_state_dict(module)
    extra = {}
    if excludes_frozen(module):  # a parameter-efficient fine-tune: the base stays out
        skip = frozen_names(module)
        model = {k: v for k, v in model.items() if k not in skip}
        extra["frozen"] = fingerprint(module)
    return {
        **extra,
        "module": model,
        "module_state": module.get_state(),
        "optimizers": [_optimizer_state(trainer, opt, named_optimizers)
                       for opt in trainer.optimizers],
        "schedulers": [sched.state_dict() for sched in trainer.schedulers],
        "backend": backend.state_dict(),  # the AMP grad scaler, among others
        "counters": {key: getattr(trainer, key) for key in COUNTERS},
        "last_val_metrics": trainer.last_val_metrics,
        "callbacks": {state_key(c): c.state_dict() for c in trainer.callbacks
                      if callable(getattr(c, "state_dict", None))},
    }


def _optimizer_state(trainer: "RunView", optimizer: torch.optim.Optimizer,
                     named: bool) -> dict[str, Any]:
    """``optimizer``'s state, built once: by name straight from ``get_optimizer_state_dict``
    once it has stepped (see :func:`~sailfin.backends.state.dcp_optimizer_state`)."""
    if named and optimizer.state:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(trainer.module, optimizer)
    state = trainer.backend.optimizer_state_dict(trainer.module, optimizer)
    return dcp_optimizer_state(trainer.module, optimizer, state) if named else state


def load_trainer_state(trainer: "RunView", state: Mapping[str, Any]) -> None:
    """Put back what :func:`trainer_state` returned (after ``setup`` built the pieces)."""
    backend, module = trainer.backend, trainer.module
    backend.load_model_state_dict(module, _with_frozen(trainer, state))
    module.update_state(state["module_state"])
    for kind, mine in (("optimizers", trainer.optimizers), ("schedulers", trainer.schedulers)):
        if len(state[kind]) != len(mine):
            raise ValueError(f"the checkpoint has {len(state[kind])} {kind}, "
                             f"get_optimizers_schedulers returned {len(mine)}")
    for opt, saved in zip(trainer.optimizers, state["optimizers"]):
        backend.load_optimizer_state_dict(module, opt, saved)
    for sched, saved in zip(trainer.schedulers, state["schedulers"]):
        sched.load_state_dict(saved)
    backend.load_state_dict(state["backend"])
    for key in COUNTERS:
        setattr(trainer, key, state["counters"][key])
    trainer.last_val_metrics = state["last_val_metrics"]
    for callback in trainer.callbacks:
        saved = state["callbacks"].get(state_key(callback))
        if saved is not None and callable(getattr(callback, "load_state_dict", None)):
            callback.load_state_dict(saved)


def _with_frozen(trainer: "RunView", state: Mapping[str, Any]) -> dict[str, Any]:
    """The saved model state, with the frozen parameters as the module holds them when the
    checkpoint left them out (after checking they are the base it was trained on)."""
    model, saved = dict(state["module"]), state.get("frozen")
    module = trainer.module
    if not excludes_frozen(module):
        if saved is not None:
            raise ValueError("it holds only the parameters that train (saved with "
                             "checkpoint_frozen_params false, as peft: sets it); build the "
                             "module as that run did")
        return model
    if saved is not None:
        why = mismatch(saved, module)
        if why:
            raise ValueError(why)
    current = trainer.backend.model_state_dict(module)
    return {**{k: current[k] for k in frozen_names(module) if k in current}, **model}


def state_key(callback: "Callback") -> str:
    """Where a callback's state sits in a checkpoint: its ``state_key``, else its class name."""
    return getattr(callback, "state_key", type(callback).__name__)


def excludes_frozen(module: torch.nn.Module) -> bool:
    """Whether ``module``'s checkpoints leave its frozen parameters out."""
    return not getattr(module, "checkpoint_frozen_params", True)
