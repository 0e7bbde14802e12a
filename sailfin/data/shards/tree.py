"""Files of a directory tree as samples, and a DataProcessor that writes them as shards."""

from __future__ import annotations

import os
from typing import Any, Sequence

from ...interfaces import DataProcessor
from .writer import ShardWriter

Sample = tuple[str, list[tuple[str, str]]]  # key, [(extension, relative path)]


def group_files(root: str) -> tuple[list[Sample], int]:
    """Samples under ``root`` in key order, and the number of files without extension."""
    groups: dict[str, list[tuple[str, str]]] = {}
    loose = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel_dir = os.path.relpath(dirpath, root)
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            base, dot, ext = name.partition(".")
            if not dot or not ext or not base:
                loose += 1
                continue
            key = base if rel_dir == "." else f"{rel_dir.replace(os.sep, '/')}/{base}"
            groups.setdefault(key, []).append((ext, os.path.join(rel_dir, name)))
    return sorted(groups.items()), loose


class WriteShards(DataProcessor):
    """Writes one run of shards: ``process(start_index, samples)`` -> the shard paths,
    numbered from ``start_index`` (parallel processes never write the same file)."""

    def __init__(self, src: str, out: str, samples_per_shard: int, prefix: str = "shard"
                 ) -> None:
        super().__init__()
        self.src, self.out = src, out
        self.samples_per_shard, self.prefix = samples_per_shard, prefix

    def process(self, start_index: int, samples: Sequence[Sample]) -> list[str]:
        with ShardWriter(self.out, self.samples_per_shard, prefix=self.prefix,
                         start_index=start_index) as writer:
            for key, members in samples:
                sample: dict[str, Any] = {"__key__": key}
                for ext, rel in members:
                    with open(os.path.join(self.src, rel), "rb") as f:
                        sample[ext] = f.read()
                writer.write(sample)
        return writer.shards
