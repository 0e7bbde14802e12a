"""The sample order of an epoch over shards: shuffled shards, then a shuffle inside
windows of consecutive shards.

It is a pure function of (samples per shard, seed, epoch, window): no world
size, worker count or micro batch enters it, so every rank computes the same
order and a run resumed on another world size continues it. Because a window
holds ``window`` shards, the samples of any stretch of positions (a step, a
rank's share of one) come from at most two windows: reads stay within a
bounded set of shards, which keeps a remote cache small and reads local.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def window_order(counts: Sequence[int], seed: int, epoch: int, window: int,
                 shuffle: bool = True) -> np.ndarray:
    """Global sample indices of epoch ``epoch`` in training order (a permutation).

    Sample ``i`` of the dataset is sample ``i - start[s]`` of shard ``s``, shards
    in the order given. With ``shuffle=False`` the order is the natural one.

    Example::

        window_order([3, 2, 4], seed=0, epoch=0, window=2)   # a permutation of range(9)
    """
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if not shuffle:
        return np.arange(total)
    if window < 1:
        raise ValueError(f"shuffle_window must be >= 1, got {window}")
    starts = np.zeros(len(counts), dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    # A generator of its own (and a tag distinct from the map-style sampler's), so
    # the order never depends on, nor disturbs, the global random streams.
    rng = np.random.default_rng([seed, epoch, 0x5A4D])
    shards = rng.permutation(len(counts))
    out = np.empty(total, dtype=np.int64)
    pos = 0
    for w in range(0, len(shards), window):
        chosen = shards[w:w + window]
        ids = np.concatenate([np.arange(starts[s], starts[s] + counts[s]) for s in chosen])
        rng.shuffle(ids)
        out[pos:pos + len(ids)] = ids
        pos += len(ids)
    return out
