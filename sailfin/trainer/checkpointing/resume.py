"""``trainer.resume``: find the checkpoint to continue from and put the trainer back there.

The checksums prove a file is the one that was written, not that it is a checkpoint
(rewritten with its checksum fixed, a manifest's step edited): :func:`check_loaded`
checks the shape a save gives it, so ``resume: auto`` falls back from such a file too.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional

import torch

from ...checkpoint.checkpointer import Checkpointer, Loaded
from ...checkpoint.errors import CheckpointCorrupt, CheckpointError
from ...checkpoint.manifest import MANIFEST
from ...logging.metrics_log import last_logged_step, trim_metrics_log
from ...checkpoint.rng import derive_rng, restore_rng
from ...checkpoint.dcp_io import load_sharded, rng_key
from ...utils.voice import say
from ..core.view import epoch_position
from .config_diff import check_config
from .init_from import all_ranks, load_initial_weights
from .memory_snapshots import snapshots_of
from .state import frozen_names, state_key

if TYPE_CHECKING:
    from ..core.view import RunView


def resume(trainer: "RunView", checkpointer: Checkpointer) -> Optional[Loaded]:
    """Apply ``trainer.args.resume`` (auto, never or a path); return what was loaded.
    With nothing to resume, a new run starts from ``trainer.init_from``'s weights, if set."""
    mode = trainer.args.resume
    checkpointer.recover()  # a save killed between its renames left its checkpoint aside
    # trainer.checkpoint.memory: the run's identity, and the snapshots every rank holds.
    snapshots = snapshots_of(trainer)
    memory = snapshots.recover(trainer, checkpointer.candidates()) if snapshots else []
    loaded = None
    if mode == "never":
        existing = checkpointer.latest()
        if existing is not None:
            raise CheckpointError(
                f"trainer.resume is never, but {checkpointer.location} holds checkpoints (newest "
                f"{existing}) that this run's saves would mix with; use another "
                "trainer.output_dir or trainer.checkpoint.dir, delete them, or resume (auto)")
    elif mode == "auto":
        loaded = _first_loadable(trainer, checkpointer, memory)
        if loaded is None:
            _start_afresh(trainer)
    else:
        loaded, error = _try_load(checkpointer, mode, trainer.dist.rank)
        if not all_ranks(trainer, loaded is not None):
            raise error or CheckpointError(f"trainer.resume: another rank could not read {mode}")
        _use(trainer, loaded)  # type: ignore[arg-type]
    if loaded is None and trainer.args.init_from:
        load_initial_weights(trainer, trainer.args.init_from)
    return loaded


def _use(trainer: "RunView", loaded: Loaded) -> None:
    # Before anything is restored: a changed config stops here; what may change is said
    # once the checkpoint is in use (damage found while loading it falls back first).
    notes: list[str] = []
    check_config(trainer, loaded.manifest, loaded.location, notes.append)
    apply(trainer, loaded)
    for note in notes:
        say(note)


def _start_afresh(trainer: "RunView") -> None:
    """No checkpoint to continue from: events a killed run logged before its first save
    would be logged again, so they go (the lock says no other run writes there)."""
    if not trainer.dist.is_main:
        return
    dropped = trim_metrics_log(os.path.join(trainer.args.output_dir, "metrics.jsonl"), 0, False)
    if dropped:
        say(f"no checkpoint to resume from: starting at step 0 and dropping {dropped} "
            "metrics.jsonl line(s) that an earlier run logged before it saved any")


def _first_loadable(trainer: "RunView", checkpointer: Checkpointer, memory: list[str]
                    ) -> Optional[Loaded]:
    """The newest checkpoint every rank can read (the memory snapshots first); say which
    damaged ones were skipped."""
    skipped = []
    for name in memory + checkpointer.candidates():
        source = snapshots_of(trainer) if name in memory else checkpointer
        loaded, error = _try_load(source, name, trainer.dist.rank)
        # Every rank must continue from the same checkpoint, even if only one
        # rank's file is damaged.
        if all_ranks(trainer, loaded is not None):
            try:  # the shards' contents are read now: damage there falls back too
                _use(trainer, loaded)  # type: ignore[arg-type]
            except CheckpointCorrupt as exc:
                error = exc
            if all_ranks(trainer, error is None):
                if skipped and trainer.dist.is_main:
                    say(f"resume: skipped damaged checkpoint(s) {', '.join(skipped)}; falling "
                        f"back to {loaded.location}, the newest complete one")  # type: ignore
                return loaded
        if isinstance(error, CheckpointCorrupt):
            say(f"resume: {error}")
        elif error is not None:
            raise error  # not damage (e.g. refused unpickling): an older one would fail alike
        skipped.append(name)
    if skipped:
        raise CheckpointError(
            f"resume: every checkpoint in {checkpointer.location} is damaged "
            f"({', '.join(skipped)}); move them away to start afresh, or set trainer.resume "
            "to a good checkpoint")
    return None


def _try_load(checkpointer: Any, name: str, rank: int
              ) -> tuple[Optional[Loaded], Optional[CheckpointError]]:
    """Read ``name`` and check it has the shape a save gives it."""
    try:
        loaded = checkpointer.load(name)
        check_loaded(loaded, rank)
        return loaded, None
    except CheckpointError as exc:
        return None, exc


def apply(trainer: "RunView", loaded: Loaded) -> None:
    """Restore every piece and this rank's random streams (metrics.jsonl: :func:`continue_log`)."""
    manifest, rank = loaded.manifest, trainer.dist.rank
    _check_data_position(trainer, manifest, loaded.location)
    state: dict[str, Any] = dict(loaded.shared["trainer"])
    try:
        if loaded.sharded is not None:  # DCP cuts it for this run
            stateful = {state_key(c): c for c in trainer.callbacks
                        if callable(getattr(c, "state_dict", None))}
            skip = frozen_names(trainer.module) if "frozen" in state else ()
            shards = load_sharded(loaded.sharded, trainer.module, trainer.optimizers, stateful,
                                  skip)
            state["callbacks"] = {**state.get("callbacks", {}), **shards.pop("callbacks", {})}
            state.update(shards)
        else:
            state["module"] = loaded.shared["model"]
        trainer.load_state_dict(state)
    except CheckpointCorrupt:
        raise  # damage found reading the shards: resume: auto falls back from it
    except (RuntimeError, ValueError, KeyError, IndexError) as exc:
        raise CheckpointError(
            f"checkpoint {loaded.location} does not fit this run: {exc}. It was saved by "
            "another recipe or configuration; point trainer.resume at a matching checkpoint, "
            "or start afresh in another trainer.output_dir") from None
    step = int(manifest["step"])
    if loaded.rank_state is not None:
        notes = restore_rng(loaded.rank_state)
    else:
        derive_rng(trainer.args.seed, rank, step)
        notes = [f"rank {rank} has no saved random state (the checkpoint ran on "
                 f"{manifest['world_size']} ranks): its random streams (dropout...) derive "
                 f"from (seed {trainer.args.seed}, rank {rank}, step {step})"]
    for note in notes:
        say(f"resume: {note}", warning=True)  # this rank's own


def continue_log(trainer: "RunView", loaded: Loaded) -> None:
    """Rank 0: metrics.jsonl cut back to the checkpoint's step, and the resume said (only
    for a run that trains on: a run resumed at its end changes no file)."""
    manifest, step = loaded.manifest, int(loaded.manifest["step"])
    if trainer.dist.is_main:
        metrics = os.path.join(trainer.args.output_dir, "metrics.jsonl")
        reached = last_logged_step(metrics)
        dropped = trim_metrics_log(metrics, step, bool(manifest.get("validated_at_step")))
        saved_world, world = manifest["world_size"], trainer.dist.world_size
        restart = trainer.dist.restart_count
        say((f"restart {restart} ({trainer.dist.launcher}): " if restart else "")
            + f"resuming from {loaded.location}: step {step}, "
            + epoch_position(int(manifest["epoch"]), int(manifest["step_in_epoch"]))
            + (f"; world size {saved_world} -> {world}" if saved_world != world
               else f"; world size {world}" if restart else "")
            + (f"; at least {reached - step} step(s) lost (the run had logged step "
               f"{reached})" if reached is not None and reached > step else "")
            + (f"; dropped {dropped} metrics.jsonl line(s) past that step" if dropped else ""))


def _check_data_position(trainer: "RunView", manifest: dict, where: str) -> None:
    """Mid-epoch, the saved step means the same samples only with the same G and dataset."""
    data = manifest.get("data") or {}
    if int(manifest["step_in_epoch"]) == 0:
        return  # an epoch boundary: any batch size or dataset continues cleanly
    for key, now, what in (("global_batch", trainer.plan.global_batch, "trainer.train_batch_size"),
                           ("num_samples", trainer.num_train_samples, "the training set size"),
                           ("seed", trainer.args.seed, "trainer.seed"),
                           ("shuffle", trainer.args.shuffle, "trainer.shuffle")):
        if key in data and data[key] != now:
            raise CheckpointError(
                f"checkpoint {where} stopped "
                f"{epoch_position(int(manifest['epoch']), int(manifest['step_in_epoch']))} "
                f"with {what} = {data[key]!r}; this run has {now!r}, so "
                "the rest of the epoch would skip or repeat samples. Resume with the same "
                f"{what}, or from a checkpoint taken at an epoch end")


# The trainer's entries (see .state.trainer_state) and the type each must have.
_TRAINER_KEYS: dict[str, tuple[type, ...]] = {
    "module_state": (object,), "optimizers": (list,), "schedulers": (list,),
    "backend": (dict,), "counters": (dict,), "last_val_metrics": (object,),
    "callbacks": (dict,)}
# the trainer's counters -> the manifest's name for the same count
_COUNTERS = {"global_step": "step", "epoch": "epoch", "step_in_epoch": "step_in_epoch",
             "samples_seen": "samples_seen"}


def check_loaded(loaded: Loaded, rank: int) -> None:
    """Raise :class:`CheckpointCorrupt` when ``loaded`` (read by ``rank``) is not what a save
    writes."""
    ref = loaded.sharded
    old_files = {"trainer": "trainer.pt", "model": "model.pt", rng_key(rank):
                 f"rng-rank{rank:05d}.pt"}

    def place(key: str) -> tuple[str, str]:
        """What to call the entry ``key`` and the file to name: a small entry of the
        shards, or (an earlier release's checkpoint) a file of its own."""
        if ref is not None and ref.entries:
            return f"checkpoint entry {ref.where(key)}", ref.file_of(key)
        shown = f"{loaded.location}/{old_files[key]}"
        return f"checkpoint file {shown}", shown

    def damaged(key: str, what: str) -> CheckpointCorrupt:
        named, file = place(key)
        return CheckpointCorrupt(f"{named} {what}: it is damaged or was rewritten after the "
                                 "save", file)

    trainer = loaded.shared.get("trainer")
    if not isinstance(trainer, dict):
        raise damaged("trainer", "is missing from the manifest" if trainer is None else
                      f"holds a {type(trainer).__name__}, not the trainer's state (a dict)")
    in_shards = set(ref.keys) if ref is not None else set()
    for key, types in _TRAINER_KEYS.items():
        if key in in_shards and key not in trainer:
            continue  # in the shards, checked by their checksums
        if key not in trainer:
            raise damaged("trainer", f"lacks {key!r}")
        if not isinstance(trainer[key], types):
            raise damaged("trainer", f"holds {key!r} as a {type(trainer[key]).__name__}")
    counters = trainer["counters"]
    for key, manifest_key in _COUNTERS.items():
        value = counters.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise damaged("trainer", f"has counter {key} = {value!r}, not a count")
        if value != loaded.manifest[manifest_key]:
            shown = f"{loaded.location}/{MANIFEST}"
            raise CheckpointCorrupt(
                f"checkpoint manifest {shown} says {manifest_key} "
                f"{loaded.manifest[manifest_key]}, but {place('trainer')[0]} holds {value}: "
                "the manifest was altered after the save", shown)
    if ref is None:  # else the model is in the shards
        _check_model(loaded.shared.get("model"), lambda what: damaged("model", what))
    rng = loaded.rank_state
    if rng is not None and not (isinstance(rng, dict)
                                and isinstance(rng.get("python"), (tuple, list))
                                and isinstance(rng.get("numpy"), dict)
                                and isinstance(rng.get("torch"), torch.Tensor)
                                and rng["torch"].dtype == torch.uint8):
        raise damaged(rng_key(rank), "does not hold random-stream state")


def _check_model(model: Any, damaged: Any) -> None:
    if model is None:
        raise damaged("is missing from the manifest")
    if not isinstance(model, dict):
        raise damaged(f"holds a {type(model).__name__}, not a state dict "
                      "(parameter name -> tensor)")
    for name, value in model.items():
        if not isinstance(name, str):
            raise damaged(f"has a key of type {type(name).__name__}")
        if not isinstance(value, torch.Tensor) and not name.endswith("_extra_state"):
            raise damaged(f"holds {name!r} as a {type(value).__name__}, not a tensor")
