"""``final/hf/``: the trained model as a ``save_pretrained`` directory, loadable without sailfin."""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING, Any

import torch

from ..trainer import Callback
from .errors import require

if TYPE_CHECKING:
    from .module import HFModule


class SavePretrained(Callback):
    """After training, rank 0 turns ``final/model.safetensors`` (which the trainer has
    just written: under fsdp, gathered one tensor at a time) into ``final/hf/``: ``config.json``,
    ``model.safetensors`` and the tokenizer, written under a temporary name and renamed.
    No rank gathers the weights a second time.

    Example (the HF modules add it themselves)::

        Trainer(module, args, callbacks=[SavePretrained(module)]).train()
        AutoModelForSequenceClassification.from_pretrained("outputs/run/final/hf")
    """

    def __init__(self, module: "HFModule") -> None:
        self.module = module

    def on_train_end(self, trainer: Any) -> None:
        if not trainer.dist.is_main:
            return
        final = os.path.join(trainer.args.output_dir, "final")
        save_pretrained_from(self.module, os.path.join(final, "model.safetensors"),
                             os.path.join(final, "hf"))


def save_pretrained_from(module: "HFModule", weights: str, out_dir: str) -> str:
    """Write ``out_dir`` from the recipe's full state dict saved at ``weights``."""
    from safetensors.torch import load_file

    transformers = require("transformers")
    state = {k[len("model."):]: v for k, v in load_file(weights).items()
             if k.startswith("model.")}
    auto = getattr(transformers, module.auto_class)
    config = module.model.config
    with torch.device("meta"):
        model = auto.from_config(config)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()  # a tied weight is stored once, under its first name
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"final/hf: {weights} lacks {', '.join(missing[:3])}: the "
                           "trainer's final weights do not match the model")
    remove_stale(out_dir)  # what an export killed part-way left
    tmp = f"{out_dir}{TMP}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    bars = transformers.utils.logging
    quiet = bars.is_progress_bar_enabled()
    bars.disable_progress_bar()  # a bar for one file in a run's log
    try:
        model.save_pretrained(tmp)
    finally:
        if quiet:
            bars.enable_progress_bar()
    module.tokenizer.save_pretrained(tmp)
    replace_dir(tmp, out_dir)
    return out_dir


# Siblings of out_dir: the export being written, and the previous one set aside.
TMP, ASIDE = ".tmp-", ".old-"


def replace_dir(new: str, out_dir: str) -> None:
    """Put the complete directory ``new`` at ``out_dir``: the old one is renamed aside,
    the new one renamed in, then the old one deleted. A kill at any point leaves at
    ``out_dir`` the previous export whole, the new one whole, or (between the renames)
    none: never a half-deleted directory that still loads. What it leaves aside is
    removed by the next export (:func:`remove_stale`)."""
    aside = f"{out_dir}{ASIDE}{os.getpid()}"
    shutil.rmtree(aside, ignore_errors=True)
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
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
                removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process's own leftovers are stale too (it is not writing them)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
