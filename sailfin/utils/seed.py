"""Seeding every random stream a recipe may draw from."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (CPU and CUDA) global generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    if torch.accelerator.is_available():
        torch.manual_seed(seed)  # also seeds every CUDA (or other accelerator) device
    else:
        # The same, without queueing seeds for devices this process cannot have: torch
        # records a stack trace for each (several ms of reading source files at start-up).
        torch.default_generator.manual_seed(seed)
