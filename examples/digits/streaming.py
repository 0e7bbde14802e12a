"""The digits example streamed from tar shards: same model, only the DataInterface changes.

A DataProcessor writes the digits (the same train/validation split as
``recipe.DigitsData``) into shards, two processes in parallel; training then
reads them through ``ShardDataset``, from the local directory or over HTTP.

    sailfin train examples/digits/config_streaming.yaml      # writes the shards if missing
    python -m examples.digits.streaming --http                # the same, served over HTTP

``--http`` starts a file server for the shard directory on 127.0.0.1 (a free
port), trains with the shard URLs pointing at it, and stops the server.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import os
import sys
import threading
from typing import Iterator, Optional, Sequence

import numpy as np

from sailfin import DataInterface, DataProcessor
from sailfin.data import ShardDataset, ShardWriter

TRAIN_SHARDS = "train/shard-{000000..000014}.tar"   # 1,438 samples, 100 per shard
VAL_SHARDS = "val/shard-{000000..000003}.tar"       # 359 samples


def digits_split(val_fraction: float = 0.2, split_seed: int = 0):
    """Images (float32, 64 values in [0, 1]) and labels, split as recipe.DigitsData does."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    order = np.random.default_rng(split_seed).permutation(len(x))
    n_val = int(len(x) * val_fraction)
    return x, digits.target, {"train": order[n_val:], "val": order[:n_val]}


class WriteDigitShards(DataProcessor):
    """``process(split, start_index, rows)`` writes those digits as shards numbered from
    ``start_index``: parallel processes get disjoint numbers, so disjoint files."""

    def __init__(self, out_dir: str, samples_per_shard: int = 100) -> None:
        super().__init__()
        self.out_dir, self.samples_per_shard = out_dir, samples_per_shard
        self.x, self.y, _ = digits_split()

    def process(self, split: str, start_index: int, rows: Sequence[int]) -> list[str]:
        with ShardWriter(os.path.join(self.out_dir, split), self.samples_per_shard,
                         start_index=start_index) as writer:
            for row in rows:
                writer.write({"__key__": f"{row:05d}", "x.npy": self.x[row],
                              "cls": int(self.y[row])})
        return writer.shards


def write_digit_shards(out_dir: str, samples_per_shard: int = 100, processes: int = 2
                       ) -> list[str]:
    """Write the train and validation shards under ``out_dir``; return their paths."""
    processor = WriteDigitShards(out_dir, samples_per_shard)
    _, _, splits = digits_split()
    jobs = []
    for split, rows in splits.items():
        # Whole shards per job: job j starts at shard (first row) / samples_per_shard.
        step = samples_per_shard * 4
        jobs += [(split, start // samples_per_shard, rows[start:start + step].tolist())
                 for start in range(0, len(rows), step)]
    written = processor.multi_process_data(jobs, process_count=processes)
    return [path for paths in written for path in paths]


class DigitsShardData(DataInterface):
    """The digits, read from shards (local paths, http(s):// or any fsspec URL).

    ``write_to``: a local directory; if its shards are missing they are written
    first (so the config runs on a fresh checkout).
    """

    def __init__(self, train_urls: str, val_urls: str, write_to: Optional[str] = None,
                 shuffle_window: int = 4, cache_dir: Optional[str] = None) -> None:
        if write_to and not os.path.exists(os.path.join(write_to, "val", "shard-000003.tar")):
            write_digit_shards(write_to)
        fields = ("x.npy", "cls")  # -> (image, label): the same batches as DigitsData
        self.train = ShardDataset(train_urls, fields=fields, shuffle_window=shuffle_window,
                                  cache_dir=cache_dir)
        self.val = ShardDataset(val_urls, fields=fields, cache_dir=cache_dir)

    def get_train_dataset(self):
        return self.train

    def get_val_dataset(self):
        return self.val


@contextlib.contextmanager
def serve_directory(directory: str) -> Iterator[str]:
    """A file server for ``directory`` on 127.0.0.1; yields its base URL; always stops."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=directory))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--http", action="store_true", help="serve the shards over HTTP")
    parser.add_argument("--shards", default="outputs/digits-shards")
    parser.add_argument("--output-dir", default=None)
    args, overrides = parser.parse_known_args(argv)
    from sailfin.cli import main as sailfin_main

    config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config_streaming.yaml")
    write_digit_shards(args.shards)
    if not args.http:
        out = args.output_dir or "outputs/digits-streaming"
        return sailfin_main(["train", config, f"--data.init_args.write_to={args.shards}",
                             f"--data.init_args.train_urls={args.shards}/{TRAIN_SHARDS}",
                             f"--data.init_args.val_urls={args.shards}/{VAL_SHARDS}",
                             f"--trainer.output_dir={out}", *overrides])
    out = args.output_dir or "outputs/digits-streaming-http"
    with serve_directory(args.shards) as base:
        print(f"serving {args.shards} at {base}")
        return sailfin_main(["train", config, "--data.init_args.write_to=null",
                             f"--data.init_args.train_urls={base}/{TRAIN_SHARDS}",
                             f"--data.init_args.val_urls={base}/{VAL_SHARDS}",
                             f"--data.init_args.cache_dir={out}/shard-cache",
                             f"--trainer.output_dir={out}", *overrides])


if __name__ == "__main__":
    sys.exit(main())
