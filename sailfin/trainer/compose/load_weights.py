"""``--checkpoint PATH`` of ``sailfin evaluate`` / ``sailfin predict``: which weights a path
names, and loading them into a recipe that is set up for evaluation. Every kind of saved
weights loads through what ``trainer.init_from`` uses (any backend's checkpoint, read
by each rank as it needs), except an exported directory (``save_pretrained`` or a PEFT
adapter), which the recipe loads itself (``load_exported``, e.g. ``sailfin.hf``).

Example::

    where = resolve_checkpoint("best", args)       # -> ("checkpoint", ".../step-00000040")
    with quiet_init_from():
        load_initial_weights(trainer, where[1])
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterator

from ...checkpoint.checkpointer import DirectoryCheckpointer
from ...checkpoint.errors import CheckpointError
from ...config.trainer import TrainerArguments
from ...distributed import DistEnv
from ...utils.voice import log
from ..checkpointing.init_from import load_initial_weights

POINTERS = ("best", "latest")
MANIFEST = "manifest.json"
FINAL = os.path.join("final", "model.safetensors")
EXPORT_MARKERS = ("config.json", "adapter_config.json")

# (kind, location): kind is "checkpoint" (a step directory or a directory of them),
# "weights" (a .safetensors file of the recipe's state dict) or "exported" (a directory
# the recipe's load_exported reads).
Source = tuple[str, str]


def resolve_checkpoint(path: str, args: TrainerArguments, dist: DistEnv) -> Source:
    """What ``path`` names: ``best`` or ``latest`` (this run's checkpoints, or a pointer
    file in any checkpoint directory), a step directory, a directory of checkpoints (its
    latest), a ``.safetensors`` file, an output directory or its ``final/`` (the final
    weights), or an exported directory (``config.json`` / ``adapter_config.json``)."""
    if path in POINTERS and not os.path.exists(path):
        root = args.checkpoint.dir or os.path.join(args.output_dir, "checkpoints")
        return "checkpoint", _pointed(root, path, args, dist)
    if os.path.isfile(path) and os.path.basename(path) in POINTERS:
        return "checkpoint", _pointed(os.path.dirname(path) or ".", os.path.basename(path),
                                      args, dist)
    if path.endswith(".safetensors"):
        if not os.path.isfile(path):
            raise CheckpointError(f"--checkpoint {path}: no such file")
        return "weights", path
    if not os.path.isdir(path):
        raise CheckpointError(
            f"--checkpoint {path} does not exist; give best, latest, a checkpoint "
            "directory (step-*), a run's checkpoints/, a run's output directory (its "
            "final/model.safetensors), a .safetensors file or a save_pretrained directory")
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return "checkpoint", path
    for final in (os.path.join(path, FINAL), os.path.join(path, "model.safetensors")):
        if os.path.isfile(final) and not any(
                os.path.isfile(os.path.join(path, m)) for m in EXPORT_MARKERS):
            return "weights", final  # an output directory, or its final/
    if any(os.path.isfile(os.path.join(path, m)) for m in EXPORT_MARKERS):
        return "exported", path
    inner = os.path.join(path, "checkpoints")
    if os.path.isdir(inner) and not any(n.startswith("step-") for n in os.listdir(path)):
        raise CheckpointError(
            f"--checkpoint {path}: this output directory has no {FINAL} (the run did not "
            f"finish); give one of its checkpoints: {inner}/best, {inner}/latest or a step")
    return "checkpoint", path  # a directory of checkpoints: init_from takes its latest


def _pointed(root: str, which: str, args: TrainerArguments, dist: DistEnv) -> str:
    if not os.path.isdir(root):
        raise CheckpointError(f"--checkpoint {which}: {root} is not a checkpoint directory; "
                              "give a path (a step directory, a run's checkpoints/)")
    reader = DirectoryCheckpointer(root, args.checkpoint, dist)
    name = reader.pointer(which)
    if name is None:
        extra = (" (no validation saved a best: set trainer.checkpoint.best_metric)"
                 if which == "best" else "")
        raise CheckpointError(f"--checkpoint {which}: {root} has no complete '{which}' "
                              f"checkpoint{extra}; give a step directory instead")
    return os.path.join(root, name)


def load_before_setup(module: Any, source: Source) -> None:
    """An exported directory: loaded into the plain recipe by its ``load_exported`` before
    the backend places it (ddp and fsdp then take rank 0's weights, as they take an
    initial model's). A rank that built the model on the meta device (fsdp) loads
    nothing: its rows come from rank 0."""
    kind, where = source
    if kind != "exported":
        return
    load = getattr(module, "load_exported", None)
    if not callable(load):
        raise CheckpointError(
            f"--checkpoint {where} is an exported directory (config.json), which "
            f"{type(module).__name__} cannot load: give a sailfin checkpoint or "
            "final/model.safetensors, or implement load_exported(path) in the recipe")
    if any(p.is_meta for p in module.parameters()):
        return
    load(where)


def load_after_setup(trainer: Any, source: Source) -> None:
    """A checkpoint or weights file: read as ``trainer.init_from`` reads it (each rank its
    own rows under fsdp), its error messages naming ``--checkpoint``."""
    kind, where = source
    if kind == "exported":
        return
    try:
        with quiet_init_from():
            load_initial_weights(trainer, where)
    except CheckpointError as exc:
        raise CheckpointError(str(exc).replace("trainer.init_from:", "--checkpoint:")) from None


@contextlib.contextmanager
def quiet_init_from() -> Iterator[None]:
    """init_from's notice speaks of a new run starting (optimizers afresh): not said here,
    where nothing trains."""
    def keep(record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith("init_from:")

    log.addFilter(keep)
    try:
        yield
    finally:
        log.removeFilter(keep)
