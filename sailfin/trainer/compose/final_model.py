"""The model a run ends with, when a callback chooses another than the last step's
(``sailfin.hf``'s ``load_best_model_at_end``: the best checkpoint): what ``final/`` holds
and what is reported (``summary.json``'s ``val``, the closing lines) are that model's.

A callback chooses by a method ``final_model(trainer)`` that returns a checkpoint's path
(or None); after the model is in place its ``on_final_model(trainer)`` is called (to
write ``final/hf`` from it). Example::

    class EndWithTheBest(Callback):
        def final_model(self, trainer):
            return trainer.checkpointer.path(trainer.checkpointer.pointer("best"))
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from ...checkpoint.storage import LocalStorage
from ...utils.voice import say
from ..checkpointing.init_from import load_initial_weights
from ..core.validation import run_validation
from .bare_weights import save_bare_weights

if TYPE_CHECKING:
    from .trainer import Trainer


def end_with_chosen_model(trainer: "Trainer", summary: dict[str, Any]) -> None:
    """Called by every rank after every ``on_train_end`` (the final state is saved, memory
    snapshots are gone: nothing saved from here on holds the chosen weights as a later
    step's). The chosen checkpoint's weights go into the module and are validated again
    (not logged: metrics.jsonl keeps the events of training); ``final/model.safetensors``
    and ``summary.json`` (``val``: their figures; ``final_model``: their step) become
    theirs, and rank 0 says which model it is."""
    for callback in trainer.callbacks:
        choose = getattr(callback, "final_model", None)
        path = choose(trainer) if callable(choose) else None
        if path is None:
            continue
        step = load_initial_weights(trainer, path, announce=False)
        results = run_validation(trainer, log=False) if trainer.val_loaders else {}
        val = next(iter(results.values())) if len(results) == 1 else results
        summary["val"] = val
        summary["final_model"] = {"step": step, "checkpoint": str(path),
                                  "chosen_by": type(callback).__name__}
        output_dir, is_main = trainer.args.output_dir, trainer.dist.is_main
        trainer.backend.save_final_weights(  # every rank: fsdp gathers one tensor at a time
            trainer.module, os.path.join(output_dir, "final", "model.safetensors"), is_main)
        # final/bare.safetensors too: every file of final/ holds the chosen weights
        save_bare_weights(trainer.module, trainer.backend, os.path.join(output_dir, "final"),
                          is_main)
        if is_main:
            _update_summary_file(os.path.join(output_dir, "summary.json"), summary)
            figures = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                for k, v in _flat(val).items())
            say(f"final model: the checkpoint of step {step} ({path}), chosen by "
                f"{type(callback).__name__}, not the last step's ({trainer.global_step}); "
                f"final/ holds it" + (f"; its validation: {figures}" if figures else ""))
        done = getattr(callback, "on_final_model", None)
        if callable(done):
            done(trainer)
        return  # one final model


def _update_summary_file(path: str, summary: dict[str, Any]) -> None:
    """summary.json with the final model's ``val`` and ``final_model`` (what the callbacks
    added to the file at the end, the time account's totals, stays)."""
    try:
        with open(path, encoding="utf-8") as fh:
            written = json.load(fh)
    except (OSError, ValueError):
        written = {}
    written.update({"val": summary["val"], "final_model": summary["final_model"]})
    LocalStorage().write_bytes(path, (json.dumps(written, indent=2, default=str)
                                      + "\n").encode("utf-8"))


def _flat(val: Any) -> dict[str, Any]:
    if not isinstance(val, dict):
        return {}
    out: dict[str, Any] = {}
    for key, value in val.items():
        if isinstance(value, dict):
            out.update({f"{key}/{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out
