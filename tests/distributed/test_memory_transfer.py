"""Replicas between two gloo ranks: a snapshot directory arrives byte for byte, under a
temporary name until complete, by exchange (both ways at once) and by send/recv."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tests.distributed.harness import errors, run_ranks

pytestmark = pytest.mark.slow


def _files(rank: int) -> dict[str, bytes]:
    return {"model.pt": random.Random(rank).randbytes(300_000 + rank), "empty.pt": b"",
            "manifest.json": f'{{"rank": {rank}}}'.encode()}


def swap(rank: int, world: int, dist_args, out: Path) -> None:
    import torch.distributed as dist

    from sailfin.checkpoint import memory_transfer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_args.master_port}",
                            rank=rank, world_size=world)
    try:
        mine = out / f"rank{rank}" / "step-00000007"
        mine.mkdir(parents=True)
        for name, data in _files(rank).items():
            (mine / name).write_bytes(data)
        other = 1 - rank
        got = memory_transfer.exchange(None, str(mine), other, other,
                                       str(out / f"replica-of-{other}-at-{rank}"), 7)
        assert sorted(os.listdir(got)) == sorted(_files(other))
        for name, data in _files(other).items():
            assert Path(got, name).read_bytes() == data, name
        if rank == 0:
            memory_transfer.send(None, str(mine), 1)
        else:
            back = memory_transfer.recv(None, 0, str(out / "fetched"), 7)
            assert os.path.basename(back) == "step-00000007"
            assert not [n for n in os.listdir(out / "fetched") if n.startswith(".tmp")]
            for name, data in _files(0).items():
                assert Path(back, name).read_bytes() == data, name
    finally:
        dist.destroy_process_group()


def test_a_snapshot_directory_travels_byte_for_byte(tmp_path):
    assert run_ranks(swap, 2, tmp_path, timeout=120) == [0, 0], errors(tmp_path)
