"""Data: the batch plan, resumable samplers and loaders, sharded datasets."""

from .plan import BatchPlan, MicroBatch
from .sampler import EvalSampler, ResumableSampler, epoch_order, sample_seed

__all__ = ["BatchPlan", "EvalSampler", "MicroBatch", "ResumableSampler", "epoch_order",
           "sample_seed", "ShardDataset", "ShardError", "ShardWriter"]


def __getattr__(name: str):
    if name in ("ShardDataset", "ShardError", "ShardWriter"):  # the shard modules load on use
        from . import shards

        return getattr(shards, name)
    raise AttributeError(f"module 'sailfin.data' has no attribute '{name}'")
