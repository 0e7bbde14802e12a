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
    tmp = f"{out_dir}.tmp-{os.getpid()}"
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
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir
