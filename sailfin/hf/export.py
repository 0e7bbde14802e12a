"""``final/hf/``: the trained model as a ``save_pretrained`` directory, loadable without sailfin.

With ``peft`` it is a PEFT adapter directory (``peft_merge: true``: the merged model as
a plain ``save_pretrained`` directory); with ``load_best_model_at_end`` it holds the
best checkpoint's weights (as ``final/model.safetensors`` does, and the figures reported are
theirs); ``sailfin export CHECKPOINT OUT`` writes the same from any
checkpoint without training.
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
from typing import TYPE_CHECKING, Any, Mapping, Optional, Union

import torch

from ..checkpoint.snapshot_dirs import pid_alive
from ..trainer import Callback
from ..utils.voice import line
from .errors import HFConfigError, require
from .export_out import Source, check_out, copy_final, remove, resolve_source, write_mark

if TYPE_CHECKING:
    from .module import HFModule


class SavePretrained(Callback):
    """After training, rank 0 turns ``final/model.safetensors`` (just written by the
    trainer, gathered one tensor at a time under fsdp) into ``final/hf/`` (config,
    weights, tokenizer), written under a temporary name and renamed: nothing is
    gathered twice.

    Example (the HF modules add it themselves)::

        Trainer(module, args, callbacks=[SavePretrained(module)]).train()
        AutoModelForSequenceClassification.from_pretrained("outputs/run/final/hf")
    """

    def __init__(self, module: "HFModule") -> None:
        self.module = module

    def on_train_end(self, trainer: Any) -> None:
        if not self.module.load_best_model_at_end:  # else once the best is in place
            self.on_final_model(trainer)

    def final_model(self, trainer: Any) -> Optional[str]:
        """With ``load_best_model_at_end``: the best checkpoint, which the trainer then
        puts in place (the module, ``final/model.safetensors``, the figures reported)."""
        if not self.module.load_best_model_at_end:
            return None
        ckpt = trainer.checkpointer
        ckpt.wait()  # the best may be the save still being written
        best = ckpt.pointer("best")
        if best is None:
            raise HFConfigError("module.init_args.load_best_model_at_end: no best checkpoint "
                                "was saved (no validation ran); validate at least once "
                                "(trainer.val_every_n_epochs or val_every_n_steps)")
        return ckpt.path(best)

    def on_final_model(self, trainer: Any) -> None:
        """``final/hf`` from ``final/model.safetensors`` (rank 0)."""
        if trainer.dist.is_main:
            final = os.path.join(trainer.args.output_dir, "final")
            save_pretrained_from(self.module, os.path.join(final, "model.safetensors"),
                                 os.path.join(final, "hf"))


def save_pretrained_from(module: "HFModule", weights: Union[str, Mapping[str, torch.Tensor]],
                         out_dir: str, mark: Optional[Source] = None) -> str:
    """Write ``out_dir`` from the recipe's full state dict (saved at ``weights``, or a
    state dict): a ``save_pretrained`` directory, or with ``peft`` an adapter directory
    (the merged model with ``peft_merge``). ``mark``: ``sailfin export``'s source, which
    marks the directory as an export (:data:`~sailfin.hf.export_out.MARK`)."""
    from safetensors.torch import load_file

    transformers = require("transformers")
    source = load_file(weights) if isinstance(weights, str) else weights
    state = {k[len("model."):]: v for k, v in source.items() if k.startswith("model.")}
    model = _model_from(module, state, weights if isinstance(weights, str) else "the module")
    remove_stale(out_dir)  # what an export killed part-way left
    tmp = f"{out_dir}{TMP}{os.getpid()}"
    remove(tmp)
    bars = transformers.utils.logging
    quiet = bars.is_progress_bar_enabled()
    bars.disable_progress_bar()  # a bar for one file in a run's log
    try:
        model.save_pretrained(tmp)
    finally:
        if quiet:
            bars.enable_progress_bar()
    module.tokenizer.save_pretrained(tmp)
    if mark is not None:
        write_mark(tmp, mark)
    replace_dir(tmp, out_dir)
    return out_dir


# Siblings of out_dir: the export being written, and the previous one set aside.
TMP, ASIDE = ".tmp-", ".old-"


def replace_dir(new: str, out_dir: str) -> None:
    """Put the complete directory ``new`` at ``out_dir`` (old one renamed aside, new one
    renamed in, old one deleted): a kill leaves the previous export whole, the new one
    whole, or (between the renames) none, never half of one; :func:`remove_stale`
    removes what it left aside."""
    aside = f"{out_dir}{ASIDE}{os.getpid()}"
    remove(aside)
    had_one = os.path.lexists(out_dir)
    if had_one:
        os.rename(out_dir, aside)
    os.rename(new, out_dir)
    if had_one:
        shutil.rmtree(aside)


def remove_stale(out_dir: str) -> list[str]:
    """Remove ``out_dir.tmp-<pid>`` and ``out_dir.old-<pid>`` siblings whose process is
    gone (an export killed part-way); return what was removed."""
    folder, base = os.path.split(os.path.abspath(out_dir))
    removed = []
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return removed
    for name in names:
        for mark in (TMP, ASIDE):
            pid = name[len(base) + len(mark):] if name.startswith(base + mark) else ""
            # this process's own leftovers are stale too (it is not writing them)
            if pid.isdigit() and (int(pid) == os.getpid() or not pid_alive(int(pid))):
                remove(os.path.join(folder, name))  # a FIFO there is not opened
                removed.append(name)
    return removed


def _model_from(module: "HFModule", state: dict[str, torch.Tensor], where: str) -> Any:
    """The model class of ``module`` (wrapped by peft when it uses it) holding ``state``."""
    transformers = require("transformers")
    auto = getattr(transformers, module.auto_class)
    config = module.model.config
    with torch.device("meta"):
        model = auto.from_config(config)
        if module.peft is not None:
            peft = require("peft")
            model = peft.get_peft_model(model, copy.deepcopy(module.peft))
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()  # a tied weight is stored once, under its first name
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"final/hf: {where} lacks {', '.join(missing[:3])}: the "
                           "trainer's final weights do not match the model")
    if module.peft is not None and module.peft_merge:
        model = model.merge_and_unload()  # base + adapters: a plain transformers model
    return model


def export_checkpoint(checkpoint: str, out_dir: str) -> str:
    """``sailfin export CHECKPOINT OUT``: the recipe the checkpoint's manifest records is
    built, the weights loaded as ``trainer.init_from`` loads them (any backend's
    checkpoint), and ``OUT`` written as ``final/hf`` would be. ``checkpoints/latest`` and
    ``checkpoints/best`` are followed; a run's output directory gives its final model.
    ``OUT`` is checked first (:func:`~sailfin.hf.export_out.check_out`): an export never
    replaces what it did not write.

    Example::

        export_checkpoint("outputs/run/checkpoints/step-00000120", "exported")
    """
    import dataclasses
    from types import SimpleNamespace

    from ..backends.precision import Precision
    from ..backends.strategy import SingleDevice
    from ..checkpoint.checkpointer import DirectoryCheckpointer
    from ..config import from_dict
    from ..config.checkpoint import CheckpointArguments
    from ..distributed import DistEnv
    from ..trainer.checkpointing.config_diff import recorded_config
    from ..trainer.checkpointing.init_from import load_initial_weights
    from .module import HFModule

    source = resolve_source(checkpoint)  # pointers followed; a run: its final model
    out_dir = check_out(out_dir, source)  # before anything is built or read
    if source.final is not None:
        return export_final(source, out_dir)
    checkpoint = source.checkpoint
    dist = DistEnv()
    manifest = DirectoryCheckpointer(checkpoint, CheckpointArguments(), dist).load(
        checkpoint, mmap=True).manifest
    recorded = recorded_config(manifest) or {}
    if not isinstance(recorded.get("module"), dict):
        raise HFConfigError(f"sailfin export: {checkpoint} records no module: section (the "
                            "run was built in Python, not by sailfin train); load it with "
                            "trainer.init_from into your module and call "
                            "sailfin.hf.export.save_pretrained_from")
    cfg = from_dict({k: v for k, v in recorded.items() if k in ("module", "data", "trainer")})
    module = cfg.build()
    if not isinstance(module, HFModule):
        raise HFConfigError(f"sailfin export: {checkpoint} was trained with "
                            f"{type(module).__name__}, not a sailfin.hf module; only those "
                            "export to a save_pretrained directory")
    # One process on the CPU reads any checkpoint, whatever backend wrote it.
    args = dataclasses.replace(cfg.trainer, backend="sp", device="cpu")
    view = SimpleNamespace(module=module, args=args, dist=dist,
                           backend=SingleDevice(Precision(), torch.device("cpu"), dist))
    load_initial_weights(view, checkpoint)
    return save_pretrained_from(module, module.state_dict(), out_dir, source)


def export_final(source: Source, out_dir: str) -> str:
    """A run's final model (``final/hf``) copied to ``out_dir``, as an export is written."""
    remove_stale(out_dir)
    tmp = f"{out_dir}{TMP}{os.getpid()}"
    remove(tmp)
    copy_final(source.final, tmp)
    write_mark(tmp, source)
    replace_dir(tmp, out_dir)
    return out_dir


def export_command(checkpoint: str, out_dir: str) -> Optional[str]:
    """The ``sailfin export`` command's work: the directory written, or None after one line
    saying what was wrong."""
    from ..checkpoint import CheckpointError
    from ..config import ConfigError

    if os.getcwd() not in sys.path:  # class_path names resolve as under sailfin train
        sys.path.insert(0, os.getcwd())
    try:
        path = export_checkpoint(checkpoint, out_dir)
    except (ConfigError, CheckpointError) as exc:
        line(f"sailfin: export: {str(exc).replace('trainer.init_from: ', '')}")
        return None
    except OSError as exc:  # OUT's folder is a file, the disk is full, ...
        line(f"sailfin: export: {exc}")
        return None
    return path
