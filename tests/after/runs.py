"""A finished run of tests/after/config.yaml, and fresh recipes to evaluate it with."""

from __future__ import annotations

from pathlib import Path

from sailfin import Trainer, load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "tests" / "after" / "config.yaml")


def trained(out: Path) -> Path:
    """A finished run in ``out`` (sp): checkpoints, best, final weights."""
    cfg = load_config(CONFIG, ["--trainer.output_dir", str(out)])
    with Trainer(cfg.build(), cfg.trainer) as trainer:
        trainer.train()
    return out


def fresh(out: Path, *overrides: str):
    cfg = load_config(CONFIG, ["--trainer.output_dir", str(out), *overrides])
    return cfg.build(), cfg.trainer
