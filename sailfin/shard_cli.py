"""``sailfin shard SRC_DIR OUT_DIR``: a directory tree of files -> tar shards with indexes.

Files are grouped into samples by their path without extension, as WebDataset does
(``cats/0001.jpg`` + ``cats/0001.cls`` = sample ``cats/0001``), member bytes copied as
they are. ``--shuffle SEED`` matters for a tree sorted by class: the training shuffle
mixes only a window of shards, which then sees every class. ``--processes P`` writes the
same shards in parallel (a DataProcessor).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Sequence

from .utils.progress_line import ProgressLine
from .utils.voice import line


def add_parser(sub: Any) -> None:
    shard = sub.add_parser(
        "shard", help="write a directory tree of files as tar shards",
        description="Group the files under SRC_DIR by path without extension "
                    "(a/0001.jpg + a/0001.cls = sample a/0001) and write them as tar "
                    "shards with indexes into OUT_DIR.")
    shard.add_argument("src", metavar="SRC_DIR")
    shard.add_argument("out", metavar="OUT_DIR")
    shard.add_argument("--samples-per-shard", type=int, default=1000, metavar="N",
                       help="samples in each shard (the last may have fewer); default 1000")
    shard.add_argument("--prefix", default="shard", help="shard names: PREFIX-000000.tar ...")
    shard.add_argument("--shuffle", type=int, default=None, metavar="SEED",
                       help="shuffle the samples with this seed before sharding")
    shard.add_argument("--processes", type=int, default=1, metavar="P",
                       help="write with P processes (the same shards as with one)")
    shard.add_argument("--overwrite", action="store_true",
                       help="replace shards already in OUT_DIR with the same prefix")


def run(args: argparse.Namespace, extra: Sequence[str]) -> int:
    if extra:
        line(f"sailfin shard: unexpected arguments {' '.join(extra)}")
        return 2
    if args.samples_per_shard < 1 or args.processes < 1:
        line("sailfin shard: --samples-per-shard and --processes must be >= 1")
        return 2
    if not os.path.isdir(args.src):
        line(f"sailfin shard: {args.src} is not a directory")
        return 2
    existing = _existing(args.out, args.prefix)
    if existing and not args.overwrite:
        tars = sum(1 for name in existing if name.endswith(".tar"))
        indexes = len(existing) - tars
        line(f"sailfin shard: {args.out} already holds {tars} '{args.prefix}' shard(s)"
             + (f" and {indexes} index(es)" if indexes else "")
             + "; pass --overwrite to replace them, or choose another OUT_DIR or --prefix")
        return 2
    for name in existing:
        os.unlink(os.path.join(args.out, name))
    from .data.shards.tree import WriteShards, group_files

    samples, loose = group_files(args.src)
    if not samples:
        line(f"sailfin shard: no files with an extension under {args.src}")
        return 2
    if args.shuffle is not None:
        import numpy as np

        order = np.random.default_rng(args.shuffle).permutation(len(samples))
        samples = [samples[i] for i in order]
    per = args.samples_per_shard
    # One job per shard, numbered by its first sample: the same shards with any --processes,
    # and a progress line as each one is written.
    jobs = [(start // per, samples[start:start + per]) for start in range(0, len(samples), per)]
    writer = WriteShards(args.src, args.out, per, args.prefix)
    progress = ProgressLine(f"writing shards into {args.out}", "samples", total=len(samples))
    done = [0]

    def written_one(paths: list) -> None:
        done[0] += len(paths)
        progress.add(min(per, len(samples) - progress.done), f"{done[0]} shard(s)")

    written = writer.multi_process_data(jobs, process_count=args.processes,
                                        on_result=written_one)
    shards = [path for paths in written for path in paths]
    progress.close(f"{len(shards)} shard(s)")
    print(f"wrote {len(samples)} samples into {len(shards)} shard(s) in {args.out}: "
          f"{os.path.basename(shards[0])} .. {os.path.basename(shards[-1])}")
    if loose:
        print(f"skipped {loose} file(s) without an extension (no field name)")
    return 0


def _existing(out: str, prefix: str) -> list[str]:
    if not os.path.isdir(out):
        return []
    return sorted(n for n in os.listdir(out)
                  if n.startswith(prefix + "-") and n.endswith((".tar", ".tar.idx")))

