"""``sailfin evaluate`` and ``sailfin predict``: a trained recipe's checkpoint on a named
split, on the config's backend (under ``torchrun``/``sailfin launch`` for ddp and fsdp).

    sailfin evaluate CONFIG.yaml --checkpoint best [--split val test ...] [--a.b value ...]
    sailfin predict CONFIG.yaml --checkpoint outputs/run --split test --out preds.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Optional, Sequence

from .utils.voice import line


def add_parsers(sub: Any) -> None:
    evaluate = sub.add_parser(
        "evaluate", help="metrics of a checkpoint on a split (val, test or a set's name)",
        description="Load a checkpoint into the recipe of CONFIG and run its val_step and "
                    "on_end_val_epoch on each split, every sample once over the ranks; "
                    "print the metrics and write OUTPUT_DIR/eval-<split>.json. "
                    "Overrides as for train: --trainer.backend ddp. See "
                    "docs/after-training.md")
    predict = sub.add_parser(
        "predict", help="a recipe's predict_step over a split, to a file",
        description="Load a checkpoint into the recipe of CONFIG and write one row per "
                    "sample of the split (its id first), in input order: JSON lines, or "
                    "parquet for a .parquet name. See docs/after-training.md")
    for parser in (evaluate, predict):
        parser.add_argument("config", help="the run's YAML config")
        parser.add_argument("--checkpoint", required=True, metavar="PATH",
                            help="best, latest, a step directory, a run's checkpoints/ or "
                                 "output directory (final weights), a .safetensors file, "
                                 "or a save_pretrained / PEFT directory (sailfin.hf)")
    evaluate.add_argument("--split", nargs="+", default=["val"], metavar="NAME",
                          help="val (default), test, or a validation/test set's name")
    predict.add_argument("--split", default="val", metavar="NAME",
                         help="val (default), test, or a set's name")
    predict.add_argument("--out", required=True, metavar="FILE",
                         help="the rows: JSON lines, or parquet if FILE ends .parquet")


def run(args: argparse.Namespace, overrides: Sequence[str],
        module_builder: Callable[[Any], Optional[Callable[..., Any]]]) -> int:
    """Build the recipe as ``sailfin train`` does (``module_builder``: fsdp's sharded
    build), load the checkpoint, evaluate or predict; 0, or 2 after one line."""
    from .checkpoint import CheckpointError
    from .config import load_config
    from .trainer import Trainer

    if os.getcwd() not in sys.path:  # class_path names resolve as under sailfin train
        sys.path.insert(0, os.getcwd())
    cfg = load_config(args.config, overrides)
    module = cfg.build(module_builder(cfg.trainer))
    try:
        with Trainer(module, cfg.trainer, hparams=cfg.to_dict()) as trainer:
            main = trainer.dist.is_main
            if args.command == "predict":
                result = trainer.predict(args.out, checkpoint=args.checkpoint,
                                         split=args.split)
                if main:
                    print(f"predict {result['split']}: {result['rows']} rows from "
                          f"{result['checkpoint']} written to {result['file']}")
                return 0
            checkpoint: Optional[str] = args.checkpoint
            for split in args.split:
                result = trainer.evaluate(checkpoint=checkpoint, split=split)
                checkpoint = None  # loaded once, for every split
                if main:
                    _print(result)
    except CheckpointError as exc:
        if trainer_rank_is_main():
            line(f"sailfin: {args.command}: {exc}")
        return 2
    return 0


def _print(result: dict) -> None:
    print(f"evaluate {result['split']} ({_count(result['samples'])} samples, "
          f"{result['checkpoint']}, {result['backend']} x {result['world_size']}):")
    metrics = result["metrics"]
    nested = any(isinstance(v, dict) for v in metrics.values())
    for name, values in (metrics.items() if nested else [("", metrics)]):
        for key, value in values.items():
            shown = f"{value:.4f}" if isinstance(value, float) else value
            print(f"  {name + '/' if name else ''}{key}: {shown}")
    print(f"  written to {result['file']}")


def _count(samples: Any) -> Any:
    return sum(samples.values()) if isinstance(samples, dict) else samples


def trainer_rank_is_main() -> bool:
    from .distributed import DistEnv
    try:
        return DistEnv.from_environ().rank == 0
    except Exception:  # noqa: BLE001 - a launcher's variables that do not add up: say it
        return True
