"""``trainer.init_from``: start a new run from a checkpoint's weights only.

The usual way to fine-tune, or to continue a finished run with a new schedule:
the weights come from the checkpoint (or a ``.safetensors`` file such as a
run's ``final/model.safetensors``); the optimizers, schedulers, counters, data
position and random streams start afresh. A run that finds a checkpoint of its
own to resume (``trainer.resume``) resumes instead: a restarted fine-tune
continues where it stopped, not from the initial weights again.

Example::

    sailfin train finetune.yaml --trainer.init_from outputs/pretrain/checkpoints
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ...checkpoint.checkpointer import DirectoryCheckpointer, say
from ...checkpoint.errors import CheckpointError

if TYPE_CHECKING:
    from ..core.trainer import Trainer


def load_initial_weights(trainer: "Trainer", path: str) -> None:
    """Load the weights at ``path`` into ``trainer.module`` (every rank reads them)."""
    if path.endswith(".safetensors"):
        if not os.path.isfile(path):
            raise CheckpointError(f"trainer.init_from: {path} does not exist; give a "
                                  ".safetensors file, a checkpoint directory or a directory "
                                  "of checkpoints")
        from safetensors.torch import load_file

        state: Any = load_file(path)
        shown, origin = path, "weights file"
    else:
        reader = DirectoryCheckpointer(path, trainer.args.checkpoint, trainer.dist)
        try:
            loaded = reader.load(path)
        except CheckpointError as exc:
            raise CheckpointError(str(exc).replace("trainer.resume:", "trainer.init_from:")
                                  ) from None
        state, shown = loaded.shared["model"], loaded.location
        origin = f"checkpoint at step {loaded.manifest['step']}"
    try:
        _load(trainer.module, state)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(
            f"trainer.init_from: the weights in {shown} do not fit this model: {exc}. Point "
            "it at weights of the same architecture") from None
    if trainer.dist.is_main:
        say(f"init_from: weights from {shown} ({origin}); the optimizers, schedule, counters "
            "and data order start afresh")


def _load(module: Any, state: Any) -> None:
    # safetensors stores one tensor for tied weights: strict loading would call the
    # other name missing, so fill it from its twin when the module ties them.
    missing, unexpected = module.load_state_dict(state, strict=False)
    own = module.state_dict(keep_vars=True)
    loaded = {id(own[name]) for name in state if name in own}
    missing = [name for name in missing if id(own[name]) not in loaded]  # tied to a loaded one
    if missing or unexpected:
        raise RuntimeError(f"missing keys {missing}, unexpected keys {unexpected}")
