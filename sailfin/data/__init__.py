"""Data: the batch plan, resumable samplers and loaders."""

from .plan import BatchPlan, MicroBatch
from .sampler import EvalSampler, ResumableSampler, epoch_order

__all__ = ["BatchPlan", "EvalSampler", "MicroBatch", "ResumableSampler", "epoch_order"]
