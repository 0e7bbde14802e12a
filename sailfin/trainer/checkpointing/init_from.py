"""``trainer.init_from``: start a new run from a checkpoint's (or a ``.safetensors``
file's) weights only; a run that finds a checkpoint of its own resumes instead.

Example::

    sailfin train finetune.yaml --trainer.init_from outputs/pretrain/checkpoints
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Optional

from ...checkpoint.checkpointer import DirectoryCheckpointer
from ...utils.voice import say
from ...checkpoint.errors import CheckpointError
from ...checkpoint.sharded import load_sharded
from ...checkpoint.weights_file import SafetensorsSource, StateDictSource, load_into
from .state import frozen_names

if TYPE_CHECKING:
    from ..core.view import RunView


def load_initial_weights(trainer: "RunView", path: str, announce: bool = True
                         ) -> Optional[int]:
    """Load the weights at ``path`` into ``trainer.module``; return the checkpoint's step
    (None for a weights file). Under fsdp each rank reads only its rows: DCP for a sharded
    checkpoint, tensor by tensor otherwise. ``announce``: rank 0 says it (init_from)."""
    step = None
    if path.endswith(".safetensors"):
        if not os.path.isfile(path):
            raise CheckpointError(f"trainer.init_from: {path} does not exist; give a "
                                  ".safetensors file, a checkpoint directory or a directory "
                                  "of checkpoints")
        with SafetensorsSource(path) as source:
            load_into(trainer.module, source)
        shown, origin = path, "weights file"
    else:
        reader = DirectoryCheckpointer(path, trainer.args.checkpoint, trainer.dist)
        try:
            # Memory-mapped: a rank touches only the pages of the rows it keeps.
            loaded = reader.load(path, mmap=True)
        except CheckpointError as exc:
            raise CheckpointError(str(exc).replace("trainer.resume:", "trainer.init_from:")
                                  ) from None
        shown, step = loaded.location, int(loaded.manifest["step"])
        origin = f"checkpoint at step {step}"
        if loaded.sharded is not None:  # DCP reads each rank's rows
            ref = dataclasses.replace(loaded.sharded, keys=["module"])
            try:
                # A parameter-efficient fine-tune's checkpoint holds no frozen base: the
                # module keeps its own (it is built on that base).
                skip = (frozen_names(trainer.module)
                        if "frozen" in (loaded.shared.get("trainer") or {}) else frozenset())
                state = load_sharded(ref, trainer.module, [], skip=skip)["module"]
                if skip:
                    current = trainer.backend.model_state_dict(trainer.module)
                    state = {**{k: current[k] for k in skip if k in current}, **state}
                trainer.backend.load_model_state_dict(trainer.module, state)
            except (CheckpointError, RuntimeError, ValueError, KeyError) as exc:
                reason = str(exc).splitlines()[0].split("do not fit this model: ")[-1]
                raise CheckpointError(
                    f"trainer.init_from: the weights in {shown} do not fit this model: "
                    f"{reason}. Point it at weights of the same architecture") from None
        elif "model" not in loaded.shared:
            raise CheckpointError(f"trainer.init_from: checkpoint {shown} holds no model "
                                  "weights (no model.pt, no shards)")
        else:
            load_into(trainer.module, StateDictSource(loaded.shared["model"], shown))
    if announce and trainer.dist.is_main:
        say(f"init_from: weights from {shown} ({origin}); the optimizers, schedule, counters "
            "and data order start afresh")
    return step
