"""A recipe switches to shards by changing only its DataInterface; the trainer follows
the dataset's order and reports skipped samples."""

from __future__ import annotations

import json

import torch

from sailfin import DataInterface, Trainer
from sailfin.data import ShardDataset, ShardWriter
from sailfin.data.shards import ShardIndex

from tests.recipes import IdDataset, LinearRecipe, args


def write_id_shards(directory, n=53, per=8):
    """IdDataset's samples (i, x_i, y_i) as shards."""
    source = IdDataset(n, seed=1)
    with ShardWriter(str(directory), samples_per_shard=per) as writer:
        for i in range(n):
            _, x, y = source[i]
            writer.write({"__key__": f"{i:05d}", "cls": i, "x.npy": x, "y.npy": y})
    return writer.shards


class ShardIdData(DataInterface):
    def __init__(self, directory, **kw):
        self.train = ShardDataset(str(directory), fields=("cls", "x.npy", "y.npy"), **kw)

    def get_train_dataset(self):
        return self.train


class WorkerRecipe(LinearRecipe):
    def get_train_dataloader(self, sampler, batch_size):
        ds = self.data.get_train_dataset()
        return torch.utils.data.DataLoader(ds, batch_size=batch_size, sampler=sampler(ds),
                                           num_workers=2)


def test_the_trainer_follows_the_shard_order_exactly_once_per_epoch(tmp_path):
    write_id_shards(tmp_path / "shards")
    data = ShardIdData(tmp_path / "shards", shuffle_window=2)
    module = LinearRecipe(data)
    summary = Trainer(module, args(tmp_path / "out", epochs=2, train_batch_size=10,
                                   micro_batch_size=5, val_every_n_epochs=0)).train()
    assert summary["samples_seen"] == 2 * 53
    seen = [i for step in module.step_ids for i in step]
    order = [data.train.epoch_order(0, e).tolist() for e in (0, 1)]
    assert seen == order[0] + order[1]
    # The model learns from shard data as from the map-style dataset.
    losses = [json.loads(line)["loss"] for line in open(tmp_path / "out" / "metrics.jsonl")
              if '"train"' in line]
    assert losses[-1] < losses[0]


def test_loader_workers_and_skipped_samples_reach_the_logs(tmp_path):
    paths = write_id_shards(tmp_path / "shards")
    index = ShardIndex.from_json(open(paths[2] + ".idx", "rb").read(), "idx")
    with open(paths[2], "r+b") as f:  # damage one x.npy (sample 17's: members cls, x, y)
        f.seek(int(index.offsets[4]))
        f.write(b"not numpy at all")
    data = ShardIdData(tmp_path / "shards", on_error="skip")
    module = WorkerRecipe(data)
    Trainer(module, args(tmp_path / "out", epochs=1, train_batch_size=10,
                         micro_batch_size=5, val_every_n_epochs=0)).train()
    seen = sorted(i for step in module.step_ids for i in step)
    assert seen == [i for i in range(53) if i != 17]
    assert data.train.skipped_samples == 1  # counted in a worker, visible here
    events = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert events[-1]["skipped_samples"] == 1
