"""A checkpoint read back has the shape a save gives it, and agrees with its manifest.

The checksums prove a file is the one that was written, not that what was written
is a checkpoint: a file rewritten with its checksum fixed (a list in ``model.pt``),
or a manifest whose step was edited to 10^12, would otherwise reach
``load_state_dict`` as a ``TypeError`` or be resumed as if true. Each check here
raises :class:`CheckpointCorrupt` naming the file, so ``resume: auto`` falls back to
the previous checkpoint as it does for a damaged file.

Example::

    loaded = checkpointer.load("step-00000010")
    check_loaded(loaded, rank=0)   # raises CheckpointCorrupt naming model.pt, trainer.pt...
"""

from __future__ import annotations

from typing import Any

import torch

from ...checkpoint.checkpointer import Loaded
from ...checkpoint.errors import CheckpointCorrupt
from ...checkpoint.manifest import MANIFEST

# trainer.pt's entries (see .state.trainer_state) and the type each must have.
_TRAINER_KEYS: dict[str, tuple[type, ...]] = {
    "module_state": (object,), "optimizers": (list,), "schedulers": (list,),
    "backend": (dict,), "counters": (dict,), "last_val_metrics": (object,),
    "callbacks": (dict,)}
# counters in trainer.pt -> the manifest's name for the same count
_COUNTERS = {"global_step": "step", "epoch": "epoch", "step_in_epoch": "step_in_epoch",
             "samples_seen": "samples_seen"}


def check_loaded(loaded: Loaded, rank: int) -> None:
    """Raise :class:`CheckpointCorrupt` when ``loaded`` (read by ``rank``) is not what a save
    writes."""
    def damaged(file: str, what: str) -> CheckpointCorrupt:
        shown = f"{loaded.location}/{file}"
        return CheckpointCorrupt(f"checkpoint file {shown} {what}: it is damaged or was "
                                 "rewritten after the save", shown)

    trainer = loaded.shared.get("trainer")
    if not isinstance(trainer, dict):
        raise damaged("trainer.pt", "is missing from the manifest" if trainer is None else
                      f"holds a {type(trainer).__name__}, not the trainer's state (a dict)")
    in_shards = set(loaded.sharded.keys) if loaded.sharded is not None else set()
    for key, types in _TRAINER_KEYS.items():
        if key in in_shards and key not in trainer:
            continue  # saved under fsdp: in the shards, checked by their checksums
        if key not in trainer:
            raise damaged("trainer.pt", f"lacks {key!r}")
        if not isinstance(trainer[key], types):
            raise damaged("trainer.pt", f"holds {key!r} as a {type(trainer[key]).__name__}")
    counters = trainer["counters"]
    for key, manifest_key in _COUNTERS.items():
        value = counters.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise damaged("trainer.pt", f"has counter {key} = {value!r}, not a count")
        if value != loaded.manifest[manifest_key]:
            shown = f"{loaded.location}/{MANIFEST}"
            raise CheckpointCorrupt(
                f"checkpoint manifest {shown} says {manifest_key} "
                f"{loaded.manifest[manifest_key]}, but trainer.pt holds {value}: the manifest "
                "was altered after the save", shown)
    if loaded.sharded is None:  # under fsdp the model is in the shards
        _check_model(loaded.shared.get("model"), damaged)
    if loaded.rank_state is not None:
        _check_rng(loaded.rank_state, f"rng-rank{rank:05d}.pt", damaged)


def _check_model(model: Any, damaged: Any) -> None:
    if model is None:
        raise damaged("model.pt", "is missing from the manifest")
    if not isinstance(model, dict):
        raise damaged("model.pt", f"holds a {type(model).__name__}, not a state dict "
                      "(parameter name -> tensor)")
    for name, value in model.items():
        if not isinstance(name, str):
            raise damaged("model.pt", f"has a key of type {type(name).__name__}")
        if not isinstance(value, torch.Tensor) and not name.endswith("_extra_state"):
            raise damaged("model.pt", f"holds {name!r} as a {type(value).__name__}, "
                          "not a tensor")


def _check_rng(state: Any, file: str, damaged: Any) -> None:
    ok = (isinstance(state, dict) and isinstance(state.get("python"), (tuple, list))
          and isinstance(state.get("numpy"), dict)
          and isinstance(state.get("torch"), torch.Tensor)
          and state["torch"].dtype == torch.uint8)
    if not ok:
        raise damaged(file, "does not hold random-stream state")
