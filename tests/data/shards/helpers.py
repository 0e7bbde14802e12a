"""Shards with known contents, and an HTTP server on 127.0.0.1 for the remote tests."""

from __future__ import annotations

import contextlib
import functools
import http.server
import threading
from typing import Iterator, Optional, Sequence

import numpy as np

from sailfin import DataInterface
from sailfin.data import ShardDataset, ShardWriter

# Uneven on purpose: a tiny shard, a big one, a last step that splits unevenly.
SIZES = (7, 13, 1, 9, 20, 5)


def sample(i: int) -> dict:
    """Sample i carries its id, so a test can see exactly which samples it got."""
    rng = np.random.default_rng(i)
    return {"__key__": f"{i:06d}", "cls": i, "x.npy": rng.standard_normal(4).astype(np.float32)}


def write_shards(directory, sizes: Sequence[int] = SIZES) -> list[str]:
    """Shard s holds ``sizes[s]`` samples; ids run on across shards."""
    paths, i = [], 0
    for s, n in enumerate(sizes):
        with ShardWriter(str(directory), samples_per_shard=n, start_index=s) as writer:
            for _ in range(n):
                writer.write(sample(i))
                i += 1
        paths += writer.shards
    return paths


class _Handler(http.server.SimpleHTTPRequestHandler):
    requests: list[str]

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def do_GET(self) -> None:
        self.requests.append(self.path)
        super().do_GET()


@contextlib.contextmanager
def http_server(directory, requests: Optional[list] = None) -> Iterator[str]:
    """Serve ``directory`` on a free port of 127.0.0.1; yields the base URL; always stops.

    Each GET's path is appended to ``requests`` when given."""
    handler_class = type("Handler", (_Handler,), {"requests": [] if requests is None
                                                  else requests})
    handler = functools.partial(handler_class, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02},
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def as_id_sample(fields) -> tuple:
    """(cls, x.npy) of a helper sample -> (id, x, y), the batches of tests.recipes."""
    import torch

    i, x = fields
    return i, torch.from_numpy(x), float(x.sum())


class ShardIdData(DataInterface):
    """The helper samples read from shards, as batches for tests.recipes.LinearRecipe."""

    def __init__(self, urls: str, allow_pipe: bool = False) -> None:
        self.train = ShardDataset(urls, fields=("cls", "x.npy"), transform=as_id_sample,
                                  allow_pipe=allow_pipe)

    def get_train_dataset(self):
        return self.train

    def get_val_dataset(self):
        return None
