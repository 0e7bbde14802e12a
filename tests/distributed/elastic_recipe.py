"""A recipe for the elastic tests and benchmark: it records, per process, which sample
ids every optimizer step trained on and when, and writes its pid, so a test can kill
it mid-run and check afterwards that no sample was skipped or seen twice."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from sailfin import DataInterface
from tests.recipes import IdDataset, LinearRecipe


def attempt_key() -> str:
    """One rendezvous round: torchrun's restart count and the world size."""
    return (f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', 'none')}"
            f"-w{os.environ.get('WORLD_SIZE', '1')}")


class ElasticRecipe(LinearRecipe):
    def __init__(self, data, out: str, step_seconds: float = 0.0, **kw) -> None:
        super().__init__(data, **kw)
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.step_seconds = step_seconds
        rank = os.environ.get("RANK", "0")
        self.tag = f"rank{rank}-{attempt_key()}-pid{os.getpid()}"
        (self.out / f"pid-{self.tag}").write_text(str(os.getpid()))
        self._log = open(self.out / f"steps-{self.tag}.jsonl", "a", buffering=1)

    def train_step(self, global_step, batch, device):
        if self.step_seconds:
            time.sleep(self.step_seconds)
        return super().train_step(global_step, batch, device)

    def on_end_train_step(self, global_step, loss, stats):
        super().on_end_train_step(global_step, loss, stats)
        self._log.write(json.dumps({"step": global_step, "ids": self.step_ids[-1],
                                    "time": time.time(), "attempt": attempt_key()}) + "\n")


class ShardIdData(DataInterface):
    """IdData's samples streamed from tar shards (see :func:`write_id_shards`)."""

    def __init__(self, shards: str, n_val: int = 10) -> None:
        from sailfin.data import ShardDataset

        self.train = ShardDataset(shards, fields=("id.cls", "x.npy", "y.npy"))
        self.val = IdDataset(n_val, 4, seed=2) if n_val else None

    def get_train_dataset(self):
        return self.train

    def get_val_dataset(self):
        return self.val


def write_id_shards(directory: str, n: int = 96, samples_per_shard: int = 7) -> None:
    """IdData's training samples (same ids, inputs and targets) as uneven shards."""
    from sailfin.data import ShardWriter

    ds = IdDataset(n, 4, seed=1)
    with ShardWriter(directory, samples_per_shard=samples_per_shard) as writer:
        for i in range(n):
            _, x, y = ds[i]
            writer.write({"__key__": f"{i:06d}", "id.cls": i, "x.npy": x.numpy(),
                          "y.npy": y.numpy()})
