"""``Trainer.evaluate`` / ``sailfin evaluate``: a checkpoint's weights through the recipe's
``val_step`` and ``on_end_val_epoch`` on a named split, with validation's own pieces
(its contiguous split over the ranks, the outputs merged and gathered in dataset order,
a 0-d output counted once per sample), so the metrics are those training logs. It
writes ``eval-<split>.json`` in the output directory and touches nothing else there:
no run lock, no metrics.jsonl, no checkpoint.

Example::

    with Trainer(module, args) as trainer:
        result = trainer.evaluate(checkpoint="outputs/run/checkpoints/best", split="val")
    result["metrics"]  # {"accuracy": 0.97, "loss": 0.11}
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional

import torch

from ...checkpoint.rng import seed_loader
from ...checkpoint.storage import LocalStorage
from ...utils.voice import configure
from ..core.pymarlin_forms import batch_size, val_epoch_end_caller
from ..core.train_log import scalar
from ..core.validation import merge_outputs
from .load_weights import load_after_setup, load_before_setup, resolve_checkpoint
from .splits import split_loaders

if TYPE_CHECKING:
    from .trainer import Trainer


def prepare(trainer: "Trainer", checkpoint: Optional[str]) -> Optional[tuple[str, str]]:
    """Set the backend up for evaluation only (once; not the training run's set-up: no
    run lock, no resume, no writers) and load ``checkpoint`` (None: the weights the
    module holds, e.g. right after :meth:`Trainer.train`). Returns what was loaded."""
    source = resolve_checkpoint(checkpoint, trainer.args, trainer.dist) if checkpoint else None
    if not (trainer._is_setup or trainer._evaluation_ready):
        configure(trainer.dist.rank)
        if source is not None:
            load_before_setup(trainer.module, source)
        trainer.backend.setup(trainer.module)
        trainer._evaluation_ready = True
    elif source is not None:
        load_before_setup(trainer.module, source)
    if source is None:  # the weights held: what an earlier call loaded, if any
        return trainer._evaluation_source
    load_after_setup(trainer, source)
    trainer._evaluation_source = source
    return source


def evaluate(trainer: "Trainer", checkpoint: Optional[str], split: str,
             write: bool = True) -> dict[str, Any]:
    """``split``'s metrics for ``checkpoint``'s weights: ``{"split", "checkpoint",
    "samples", "metrics"}`` (metrics by dataset name when the split has several), also
    written to ``<output_dir>/eval-<split>.json`` by rank 0 when ``write``."""
    source = prepare(trainer, checkpoint)
    args, dist, module, backend = trainer.args, trainer.dist, trainer.module, trainer.backend
    size = args.val_batch_size or _micro_batch(args, dist.world_size)
    loaders, _ = split_loaders(module, split, size, dist)
    step = trainer.global_step
    end_epoch = val_epoch_end_caller(module)
    was_training = module.training
    backend.sync_buffers(module)  # rank 0's BatchNorm statistics everywhere, as validation
    module.eval()
    metrics: dict[str, dict[str, float]] = {}
    samples: dict[str, int] = {}
    try:
        with torch.no_grad():
            for name, loader in loaders.items():
                seed_loader(loader, args.seed, step, dist.rank)
                sizes: list[int] = []  # per batch: a 0-d output counts once per sample
                local = merge_outputs(backend.validation_outputs(
                    module, step, _counted(loader, sizes)), sizes=sizes)
                outputs = backend.gather_outputs(local)
                got = end_epoch(step, outputs, name) or {}
                metrics[name] = {k: scalar(v) for k, v in got.items()}
                counts = backend.gather_scalars(torch.tensor([sum(sizes)], dtype=torch.int64))
                samples[name] = int(counts.sum())
    finally:
        module.train(was_training)
    one = len(metrics) == 1
    result = {"split": split, "checkpoint": source[1] if source else None,
              "backend": args.backend, "world_size": dist.world_size,
              "samples": next(iter(samples.values())) if one else samples,
              "metrics": next(iter(metrics.values())) if one else metrics}
    if write and dist.is_main:
        path = os.path.join(args.output_dir, f"eval-{_file_part(split)}.json")
        os.makedirs(args.output_dir, exist_ok=True)
        # A temporary file renamed: a reader never sees half of it.
        LocalStorage().write_bytes(path, (json.dumps(result, indent=2) + "\n").encode())
        result["file"] = path
    return result


def _counted(loader: Iterable[Any], sizes: list[int]) -> Iterator[Any]:
    for batch in loader:
        sizes.append(batch_size(batch))
        yield batch


def _micro_batch(args: Any, world_size: int) -> int:
    """Training's micro-batch where it is a number, else the global batch's share."""
    if isinstance(args.micro_batch_size, int):
        return args.micro_batch_size
    share = max(1, args.train_batch_size // world_size)
    limit = args.gpu_batch_size_limit
    return min(share, limit) if limit else share


def _file_part(split: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in split)
