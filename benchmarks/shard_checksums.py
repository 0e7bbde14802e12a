"""The cost of the sharded checkpoint's checksums: a ~100 MB DCP save with and without.

One process saves a state of ``--mb`` MB (fp32 tensors of 4 MB) with DCP's
``FileSystemWriter`` (the reference) and with sailfin's checksummed writer
(the same writer, then each file read back from the page cache and
checksummed), interleaved (A B, B A, ...), into a fresh directory each time.
The figure is the median over rounds of checksummed / plain save time; the
time to verify the files on load (what a resume adds) is printed beside it,
with the checksum used (CRC-32C where ``google-crc32c``/``crc32c`` is
installed, zlib's CRC-32 otherwise).

    python benchmarks/shard_checksums.py [--mb 100] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import add_load_options, interleave, ratios, start, summary  # noqa: E402

from sailfin.checkpoint.shard_checksums import (ALGORITHM, checksummed_writer,  # noqa: E402
                                                describe, verify)
from sailfin.checkpoint.storage import LocalStorage  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=100, help="state size in MB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to save (default: a temp dir)")
    add_load_options(parser)
    opts = parser.parse_args()
    load = start(opts, "shard_checksums.py")
    torch.manual_seed(0)
    state = {f"t{i}": torch.randn(1 << 20) for i in range(max(1, opts.mb // 4))}
    root = tempfile.mkdtemp(prefix="sailfin-bench-", dir=opts.dir)
    verify_seconds: list[float] = []
    manifest: dict = {}

    def save(checksummed: bool):
        def go(i: int) -> float:
            path = os.path.join(root, f"{'c' if checksummed else 'p'}{i}")
            writer = (checksummed_writer(dcp.FileSystemWriter, path, single_file_per_rank=True)
                      if checksummed else dcp.FileSystemWriter(path, single_file_per_rank=True))
            started = time.perf_counter()
            dcp.save(state, storage_writer=writer, no_dist=True)
            took = time.perf_counter() - started
            if checksummed:
                manifest["files"] = describe(writer.sailfin_checksums)
                started = time.perf_counter()
                verify(LocalStorage(), path, manifest["files"])
                verify_seconds.append(time.perf_counter() - started)
            shutil.rmtree(path)
            return took
        return go

    try:
        rounds = interleave(opts.rounds, {"plain": save(False), "checksummed": save(True)},
                            on_round=lambda n, v: print(
                                f"round {n}: plain {v['plain']:.3f} s, checksummed "
                                f"{v['checksummed']:.3f} s", flush=True))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    size = sum(e["size"] for e in manifest["files"].values()) / 1e6
    plain = statistics.median(r["plain"] for r in rounds)
    extra = (f"{ALGORITHM}; {size:.0f} MB; plain save {plain:.3f} s; verify on load "
             f"{statistics.median(verify_seconds):.3f} s")
    summary("shard_checksums.py", "checksummed / plain save time",
            ratios(rounds, "checksummed", "plain"), load, torch.get_num_threads(), extra)


if __name__ == "__main__":
    main()
