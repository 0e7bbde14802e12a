"""Shards over HTTP (a server on 127.0.0.1, stopped after each test) and fsspec stores."""

from __future__ import annotations

import os
import socket

import pytest

from sailfin.data import ShardDataset, ShardError
from sailfin.data.shards import ShardCache

from .helpers import SIZES, http_server, write_shards
from .test_errors import load_all

PATTERN = "/shard-{000000..000005}.tar"


@pytest.fixture()
def shards(tmp_path):
    write_shards(tmp_path / "data")
    return tmp_path / "data"


def cached_tars(cache):
    return sorted(n for n in os.listdir(cache) if n.endswith(".tar"))


@pytest.mark.parametrize("workers", [0, 2])
def test_http_shards_are_fetched_once_and_read_exactly_once(shards, tmp_path, workers):
    requests: list[str] = []
    cache = tmp_path / "cache"
    with http_server(shards, requests) as base:
        ds = ShardDataset(base + PATTERN, fields=("cls",), cache_dir=str(cache))
        assert len(ds) == sum(SIZES)
        assert sorted(requests) == sorted(f"/shard-{s:06d}.tar.idx" for s in range(6))
        assert cached_tars(cache) == []  # indexes only: shards come when read
        assert sorted(load_all(ds, workers)) == list(range(sum(SIZES)))
        # Each shard downloaded once, even with two worker processes reading it.
        tars = [r for r in requests if r.endswith(".tar")]
        assert sorted(tars) == [f"/shard-{s:06d}.tar" for s in range(6)]
        assert len(cached_tars(cache)) == 6
        again = ShardDataset(base + PATTERN, fields=("cls",), cache_dir=str(cache))
        assert sorted(load_all(again)) == list(range(sum(SIZES)))
        assert len(requests) == 12  # the second dataset used the cache for everything


def test_http_plain_tars_are_indexed_at_start_up_and_the_index_cached(shards, tmp_path):
    for name in os.listdir(shards):
        if name.endswith(".idx"):
            os.unlink(shards / name)
    requests: list[str] = []
    cache = tmp_path / "cache"
    with http_server(shards, requests) as base:
        ds = ShardDataset(base + PATTERN, fields=("cls",), cache_dir=str(cache))
        assert len(ds) == sum(SIZES) and len(cached_tars(cache)) == 6
        count = len(requests)
        assert sorted(load_all(ds)) == list(range(sum(SIZES)))
        assert len(requests) == count  # read from the copies fetched for indexing
        ShardDataset(base + PATTERN, cache_dir=str(cache))
        assert len(requests) == count


def test_unresolvable_urls_fail_at_start_up_naming_them(shards, tmp_path):
    with http_server(shards) as base:
        with pytest.raises(ShardError, match=rf"failed to download shard {base}/nope.tar "
                                             r".*HTTP Error 404"):
            ShardDataset([base + "/shard-000000.tar", base + "/nope.tar"],
                         cache_dir=str(tmp_path / "c"))
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/shard-000000.tar"
    with pytest.raises(ShardError, match=rf"cannot read {url}.idx.*reachable"):
        ShardDataset(url, cache_dir=str(tmp_path / "c"))


def test_a_download_that_fails_mid_epoch(shards, tmp_path, caplog):
    with http_server(shards) as base:
        ds = ShardDataset(base + PATTERN, fields=("cls",), cache_dir=str(tmp_path / "a"),
                          download_attempts=2)
        skipping = ShardDataset(base + PATTERN, fields=("cls",), on_error="skip",
                                cache_dir=str(tmp_path / "b"), download_attempts=1)
        assert skipping[0] == (0,)  # shard 0 is in the cache; the server then goes away
    with pytest.raises(ShardError, match=rf"failed to download shard {base}/shard-000000.tar "
                                         r"\(tried 2 time"):
        ds[0]
    got = [skipping[i] for i in range(len(skipping))]
    assert [g for g in got if g is not None] == [(i,) for i in range(SIZES[0])]
    assert skipping.skipped_samples == sum(SIZES) - SIZES[0]


def test_a_shard_that_changed_on_the_server(shards, tmp_path):
    with http_server(shards) as base:
        ds = ShardDataset(base + "/shard-000000.tar", cache_dir=str(tmp_path / "c"))
        with open(shards / "shard-000000.tar", "ab") as f:
            f.write(b"\0" * 1024)
        with pytest.raises(ShardError, match="rewritten after it was indexed"):
            ds[0]


def test_the_cache_keeps_under_its_size_limit(shards, tmp_path):
    sizes = sorted(os.path.getsize(shards / f"shard-{s:06d}.tar") for s in range(6))
    limit = sum(sizes[-2:])  # room for two shards
    with http_server(shards) as base:
        with pytest.raises(ValueError, match=r"cache_limit=\d+ bytes cannot hold two "
                                             r"shuffle windows"):
            ShardDataset(base + PATTERN, cache_dir=str(tmp_path / "c"), cache_limit=limit)
        ds = ShardDataset(base + PATTERN, fields=("cls",), cache_dir=str(tmp_path / "c"),
                          cache_limit=limit, shuffle_window=1)
        assert sorted(load_all(ds)) == list(range(sum(SIZES)))
    total = sum(os.path.getsize(tmp_path / "c" / n) for n in cached_tars(tmp_path / "c"))
    assert 0 < total <= limit


def test_cache_sizes_parse():
    assert ShardCache(limit="2GB").limit == 2 * 10**9
    assert ShardCache(limit="512MiB").limit == 512 * 2**20
    with pytest.raises(ValueError, match="20GB"):
        ShardCache(limit="lots")


def test_fsspec_store_with_glob(shards, tmp_path):
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    for name in os.listdir(shards):
        fs.pipe(f"/sailfin-test/{name}", (shards / name).read_bytes())
    try:
        ds = ShardDataset("memory://sailfin-test/shard-*.tar", fields=("cls",),
                          cache_dir=str(tmp_path / "c"))
        assert len(ds.urls) == 6 and len(ds) == sum(SIZES)
        assert sorted(load_all(ds)) == list(range(sum(SIZES)))
    finally:
        fs.rm("/sailfin-test", recursive=True)
