"""``trainer.init_from``: start a new run from a checkpoint's (or a ``.safetensors``
file's) weights only; a run that finds a checkpoint of its own resumes instead.

Example::

    sailfin train finetune.yaml --trainer.init_from outputs/pretrain/checkpoints
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Optional

import torch

from ...checkpoint.checkpointer import DirectoryCheckpointer
from ...utils.voice import say
from ...checkpoint.errors import CheckpointCorrupt, CheckpointError
from ...checkpoint.dcp_io import load_sharded
from ...backends.weights_file import SafetensorsSource, StateDictSource, load_into
from .frozen_base import mismatch
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
        error: Optional[CheckpointError] = None
        try:
            # Memory-mapped: a rank touches only the pages of the rows it keeps.
            loaded = reader.load(path, mmap=True)
        except CheckpointError as exc:
            said = str(exc).replace("trainer.resume:", "trainer.init_from:")
            error = (CheckpointCorrupt(said, exc.file) if isinstance(exc, CheckpointCorrupt)
                     else CheckpointError(said))
        # Each rank checked its share of the files (and read its small entries, each after
        # its own CRC-32, weights_only): none reads the model until all agree.
        if not all_ranks(trainer, error is None):
            raise error or CheckpointError(f"trainer.init_from: another rank found {path} "
                                           "damaged; its message names the file")
        shown, step = loaded.location, int(loaded.manifest["step"])
        origin = f"checkpoint at step {step}"
        saved = loaded.shared.get("trainer")
        if isinstance(saved, dict) and "frozen" in saved:  # adapters: onto their base only
            why = mismatch(saved["frozen"], trainer.module)
            if why:
                raise CheckpointError(
                    f"trainer.init_from: checkpoint {shown} holds only the parameters that "
                    f"train, and {why}; build the module on the base it was trained on")
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
            except CheckpointCorrupt as exc:
                raise CheckpointCorrupt(f"trainer.init_from: {exc}", exc.file) from None
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


def all_ranks(trainer: Any, ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (a collective: every rank calls it)."""
    if trainer.dist.world_size == 1:
        return ok
    flag = torch.tensor(1.0 if ok else 0.0, device=trainer.backend.device)
    return bool(trainer.backend.all_reduce_mean(flag).item() == 1.0)
