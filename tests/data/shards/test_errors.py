"""Bad data: errors that name shard, key and byte offset; on_error='skip' counts."""

from __future__ import annotations

import io
import logging
import os
import tarfile

import pytest
import torch

from sailfin.data import BatchPlan, ResumableSampler, ShardDataset, ShardError, ShardWriter
from sailfin.data.shards import ShardIndex

from .helpers import sample, write_shards


def load_all(ds, workers=0, micro=4):
    plan = BatchPlan.create(micro, micro, 1)
    sampler = ResumableSampler(len(ds), plan, 0, seed=0, order=ds.epoch_order)
    loader = torch.utils.data.DataLoader(ds, batch_size=micro, sampler=sampler,
                                         num_workers=workers)
    batches = iter(loader)
    try:
        return [i for batch in batches for i in batch[0].tolist()]
    finally:
        # When a worker's error propagates, the traceback keeps this iterator alive and
        # its workers would be shut down whenever the garbage collector gets to it
        # (racing multiprocessing's queue teardown); shut them down now instead.
        if workers:
            batches._shutdown_workers()


def index_of(path):
    return ShardIndex.from_json(open(path + ".idx", "rb").read(), path)


def test_truncated_shard_fails_at_start_up_naming_it(tmp_path):
    paths = write_shards(tmp_path, [5, 5])
    cut = index_of(paths[1]).offsets[6]  # inside sample 3 of shard 1
    os.truncate(paths[1], cut)
    with pytest.raises(ShardError, match=rf"shard {paths[1]} is {cut} bytes but its index"):
        ShardDataset(str(tmp_path))


@pytest.mark.parametrize("workers", [0, 2])
def test_truncated_shard_with_skip_counts_the_lost_samples(tmp_path, workers, caplog):
    paths = write_shards(tmp_path, [5, 5])
    cut = index_of(paths[1]).offsets[6]  # samples 8 and 9 lie (partly) past the cut
    os.truncate(paths[1], cut)
    with caplog.at_level(logging.WARNING, "sailfin.data.shards"):
        ds = ShardDataset(str(tmp_path), fields=("cls",), on_error="skip")
        got = load_all(ds, workers)
    assert sorted(got) == list(range(8))  # ids 0..7 survive
    assert ds.skipped_samples == 2
    if workers == 0:  # workers log in their own processes
        assert "truncated" in caplog.text and "skipped sample (2 so far)" in caplog.text


def _corrupt(path, offset, data=b"garbage!"):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_a_corrupt_member_names_shard_key_and_offset(tmp_path):
    paths = write_shards(tmp_path, [4])
    index = index_of(paths[0])
    offset = int(index.offsets[5])  # sample 2's x.npy (members: cls, x.npy)
    _corrupt(paths[0], offset)
    # Without the checksum the decoder finds the damage (an index without checksums).
    ds = ShardDataset(paths[0], fields=("cls", "x.npy"), verify_checksums=False)
    assert ds[1][0] == 1
    with pytest.raises(ShardError) as err:
        ds[2]
    message = str(err.value)
    assert f"shard {paths[0]}, sample '000002' at byte {offset}" in message
    assert "cannot decode '.x.npy'" in message
    assert (err.value.url, err.value.key, err.value.offset) == (paths[0], "000002", offset)
    # Through DataLoader workers the same message reaches the main process.
    with pytest.raises(ShardError, match="sample '000002' at byte"):
        load_all(ds, workers=2)
    skipping = ShardDataset(paths[0], fields=("cls", "x.npy"), on_error="skip")
    assert sorted(load_all(skipping, workers=2)) == [0, 1, 3]
    assert skipping.skipped_samples == 1


def test_a_missing_member_is_named(tmp_path):
    with ShardWriter(str(tmp_path), samples_per_shard=10) as writer:
        writer.write(sample(0))
        writer.write({"__key__": "000001", "cls": 1})  # no x.npy
    ds = ShardDataset(str(tmp_path), fields=("cls", "x.npy"))
    with pytest.raises(ShardError, match=r"sample '000001' at byte \d+: has no '.x.npy' "
                                         r"member \(it has .cls\)"):
        ds[1]
    assert ShardDataset(str(tmp_path), fields=("cls", "x.npy"), on_error="skip")[1] is None


def test_a_damaged_header_of_an_unindexed_tar(tmp_path, caplog):
    with tarfile.open(tmp_path / "plain.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(4):
            info = tarfile.TarInfo(f"{i:03d}.cls")
            info.size = 1
            tar.addfile(info, io.BytesIO(str(i).encode()))
    _corrupt(tmp_path / "plain.tar", 2 * 1024 + 100)  # the third member's header
    with pytest.raises(ShardError, match=r"plain.tar at byte 2048: header at byte 2048 has a "
                                         r"bad checksum"):
        ShardDataset(str(tmp_path / "plain.tar"))
    with caplog.at_level(logging.WARNING, "sailfin.data.shards"):
        ds = ShardDataset(str(tmp_path / "plain.tar"), on_error="skip", fields=("cls",))
    assert [ds[i] for i in range(len(ds))] == [(0,), (1,)]
    assert "using the 2 members before it" in caplog.text
    assert not (tmp_path / "plain.tar.idx").exists()  # a repaired shard is indexed again


def test_an_index_that_does_not_match_its_shard(tmp_path):
    (path,) = write_shards(tmp_path, [3])
    with open(path, "ab") as f:
        f.write(b"\0" * 512)  # rewritten after indexing: longer
    for on_error in ("raise", "skip"):
        with pytest.raises(ShardError, match="rewritten after it was indexed"):
            ShardDataset(path, on_error=on_error)
    (tmp_path / "shard-000000.tar.idx").write_text("{not json")
    with pytest.raises(ShardError, match=r"shard index .*\.idx is unreadable.*delete it"):
        ShardDataset(path)


def test_a_micro_batch_with_no_readable_sample_is_an_error_even_when_skipping(tmp_path):
    (path,) = write_shards(tmp_path, [4])
    os.truncate(path, int(index_of(path).offsets[0]) + 1)
    ds = ShardDataset(path, on_error="skip")
    with pytest.raises(ShardError, match="every sample of a micro-batch of 2 is unreadable"):
        ds.__getitems__([0, 1])


def test_on_error_typo_is_rejected_with_a_suggestion(tmp_path):
    write_shards(tmp_path, [1])
    with pytest.raises(ValueError, match="did you mean 'skip'"):
        ShardDataset(str(tmp_path), on_error="skp")


def test_skip_counts_are_shared_with_copies_and_removed_with_the_dataset(tmp_path):
    import gc
    import pickle

    paths = write_shards(tmp_path, [4])
    _corrupt(paths[0], int(index_of(paths[0]).offsets[1]))  # sample 0's x.npy
    ds = ShardDataset(paths[0], fields=("cls", "x.npy"), on_error="skip")
    copy = pickle.loads(pickle.dumps(ds))  # what a spawned worker receives
    assert copy[0] is None and ds.skipped_samples == 1
    counter_file = ds._skipped.path
    del ds, copy
    gc.collect()
    assert not os.path.exists(counter_file)


@pytest.mark.slow
def test_skip_counts_from_spawned_workers(tmp_path):
    paths = write_shards(tmp_path, [4, 4])
    _corrupt(paths[1], int(index_of(paths[1]).offsets[3]))  # sample 5's x.npy
    ds = ShardDataset(str(tmp_path), fields=("cls", "x.npy"), on_error="skip")
    plan = BatchPlan.create(4, 4, 1)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=4, sampler=ResumableSampler(len(ds), plan, order=ds.epoch_order),
        num_workers=2, multiprocessing_context="spawn", timeout=120)
    assert sorted(i for batch in loader for i in batch[0].tolist()) == [0, 1, 2, 3, 4, 6, 7]
    assert ds.skipped_samples == 1


# -- checksums ---------------------------------------------------------------------------------
def test_a_changed_byte_fails_its_checksum_naming_shard_member_and_offset(tmp_path):
    paths = write_shards(tmp_path, [4])
    index = index_of(paths[0])
    assert index.crc32 is not None and len(index.crc32) == 8
    offset = int(index.offsets[5])  # sample 2's x.npy
    with open(paths[0], "r+b") as f:  # one byte of the float data: it still decodes
        f.seek(offset + 130)
        byte = f.read(1)
        f.seek(offset + 130)
        f.write(bytes([byte[0] ^ 1]))
    # Without checking it trains silently on the changed value.
    assert ShardDataset(paths[0], fields=("cls", "x.npy"), verify_checksums=False)[2][0] == 2
    ds = ShardDataset(paths[0], fields=("cls", "x.npy"))
    assert ds[1][0] == 1 and ds[3][0] == 3
    with pytest.raises(ShardError) as err:
        ds[2]
    assert (err.value.url, err.value.key, err.value.offset) == (paths[0], "000002", offset)
    assert f"sample '000002' at byte {offset}: member '.x.npy' does not match its CRC-32" \
        in str(err.value)
    skipping = ShardDataset(paths[0], fields=("cls", "x.npy"), on_error="skip")
    assert sorted(load_all(skipping)) == [0, 1, 3] and skipping.skipped_samples == 1


def test_an_index_without_checksums_is_still_read(tmp_path):
    import json

    paths = write_shards(tmp_path, [4])
    doc = json.loads(open(paths[0] + ".idx").read())
    del doc["crc32"]
    open(paths[0] + ".idx", "w").write(json.dumps(doc))
    ds = ShardDataset(paths[0], fields=("cls", "x.npy"))
    assert [ds[i][0] for i in range(4)] == [0, 1, 2, 3]


def test_a_scanned_tar_gets_checksums(tmp_path):
    with tarfile.open(tmp_path / "plain.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(3):
            data = f"{i}".encode()
            info = tarfile.TarInfo(f"{i:04d}.cls")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    ds = ShardDataset(str(tmp_path / "plain.tar"), fields=("cls",))
    assert ds.indexes[0].crc32 is not None
    assert [ds[i][0] for i in range(3)] == [0, 1, 2]


def test_an_index_with_out_of_order_offsets_names_the_index(tmp_path):
    import json

    paths = write_shards(tmp_path, [4])
    doc = json.loads(open(paths[0] + ".idx").read())
    doc["offsets"][2], doc["offsets"][3] = doc["offsets"][3], doc["offsets"][2]
    open(paths[0] + ".idx", "w").write(json.dumps(doc))
    with pytest.raises(ShardError, match=rf"shard index {paths[0]}.idx is unreadable \(member 3 "
                                         r"starts at byte \d+, inside or before member 2"):
        ShardDataset(paths[0], fields=("cls", "x.npy"))
