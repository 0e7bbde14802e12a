"""Sharded data: write tar shards with an index, read them as a map-style dataset.

See the README section "Streaming from shards". The pieces: :class:`ShardWriter`
(writing), :class:`ShardDataset` (reading, locally, over HTTP or from object
storage), :func:`window_order` (the epoch order), :class:`ShardError` (bad data).
"""

from ..sampler import window_order
from .dataset import ShardDataset
from .errors import ShardError
from .index import ShardIndex
from .remote import ShardCache, expand_urls
from .writer import ShardWriter

__all__ = ["ShardCache", "ShardDataset", "ShardError", "ShardIndex", "ShardWriter",
           "expand_urls", "window_order"]
