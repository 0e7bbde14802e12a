"""Sharded data: write tar shards with an index (:class:`ShardWriter`), read them as a
map-style dataset (:class:`ShardDataset`), locally, over HTTP or from object storage
(docs/streaming.md)."""

from ..sampler import window_order
from .dataset import ShardDataset
from .errors import ShardError
from .index import ShardIndex
from .remote import ShardCache, expand_urls
from .writer import ShardWriter

__all__ = ["ShardCache", "ShardDataset", "ShardError", "ShardIndex", "ShardWriter",
           "expand_urls", "window_order"]
