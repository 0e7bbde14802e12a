"""Replicas between two gloo ranks: a buffer set arrives byte for byte, its header
committed last, by exchange (both ways at once) and by a one-way send."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.distributed.harness import errors, run_ranks

pytestmark = pytest.mark.slow


def swap(rank: int, world: int, dist_args, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from sailfin.checkpoint.snapshot_dirs import exchange
    from sailfin.checkpoint.snapshot_sets import Location, read_header, read_set
    from sailfin.checkpoint.snapshots import SnapshotStore
    from tests.checkpoint.test_memory import facts

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_args.master_port}",
                            rank=rank, world_size=world)
    try:
        store = SnapshotStore(str(out / f"node{rank}"), rank=rank, world_size=2)
        weight = torch.randn(300_000 + rank, generator=torch.Generator().manual_seed(rank))
        store.take(7, facts(7, world_size=2), {"model": {"w": weight}, "trainer": {"n": rank}}, {"r": rank})
        store.wait()
        mine = store.inventory()[rank][7]
        other = 1 - rank
        into = Location(str(out / f"replica-of-{other}-at-{rank}"), "b")
        assert exchange(None, mine, other, other, into) == 7
        for ext in ("json", "pt", "bin"):
            want = Path(str(out / f"node{other}" / f"rank{other:05d}" / f"a.{ext}")).read_bytes()
            got = Path(into.path(ext)).read_bytes()
            assert got == want[:len(got)] and len(got) >= len(want) - 64, ext
        state = read_set(into, read_header(into))
        assert state["shared"]["trainer"]["n"] == other and state["rank"]["r"] == other
        if rank == 0:  # one way: the receiver only receives
            exchange(None, mine, 1, None, None)
        else:
            fetched = Location(str(out / "fetched"), "a")
            assert exchange(None, None, None, 0, fetched) == 7
            assert not [n for n in os.listdir(out / "fetched") if ".tmp" in n]
            assert read_set(fetched, read_header(fetched))["rank"]["r"] == 0
        store.close()
    finally:
        dist.destroy_process_group()


def test_a_buffer_set_travels_byte_for_byte(tmp_path):
    assert run_ranks(swap, 2, tmp_path, timeout=120) == [0, 0], errors(tmp_path)
