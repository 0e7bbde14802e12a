"""Every file of a sharded (fsdp) checkpoint has a checksum in the manifest; a damaged
shard is named and ``resume: auto`` falls back to the newest intact checkpoint."""

from __future__ import annotations

import io
import json
import pickle
import struct
import zipfile

import pytest

from sailfin.checkpoint import CheckpointCorrupt
from sailfin.checkpoint.shard_checksums import ALGORITHM, checksum_stream, verify
from sailfin.checkpoint.storage import LocalStorage
from tests.backends.test_fsdp import assert_close, run, weights


def _flip(path, offset, mask=0xFF):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)[0]
        fh.seek(offset)
        fh.write(bytes([byte ^ mask]))


def _tensor_data_offset(shards):
    """The offset of the largest tensor's first float's high byte in ``__0_0.distcp``:
    DCP's index gives each tensor's torch.save record, the record's zip its data."""
    metadata = pickle.loads((shards / ".metadata").read_bytes())
    infos = [i for i in metadata.storage_data.values() if i.relative_path == "__0_0.distcp"]
    largest = max(infos, key=lambda i: i.length)
    record = (shards / "__0_0.distcp").read_bytes()[largest.offset:largest.offset + largest.length]
    entry = next(i for i in zipfile.ZipFile(io.BytesIO(record)).infolist()
                 if i.filename.endswith("/data/0"))
    name_len, extra_len = struct.unpack("<HH", record[entry.header_offset + 26:
                                                      entry.header_offset + 30])
    return largest.offset + entry.header_offset + 30 + name_len + extra_len + 3


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted fsdp run: its final weights, and its checkpoint directory."""
    out = run(tmp_path_factory.mktemp("ref"), "fsdp", "fsdp")
    return weights(out), out


def test_the_manifest_lists_each_shard_file_with_its_checksum(reference):
    _, out = reference
    step = out / "checkpoints" / "step-00000010"
    files = json.loads((step / "manifest.json").read_text())["sharded"]["files"]
    assert set(files) == {".metadata", "__0_0.distcp"}
    for name, entry in files.items():
        with open(step / "shards" / name, "rb") as fh:
            size, crc = checksum_stream(fh)
        assert entry == {"size": size, ALGORITHM: f"{crc:08x}"}


@pytest.mark.parametrize("where", ["near the start", "in tensor data", "in the index"])
def test_a_damaged_shard_is_named_and_the_resume_falls_back(tmp_path, capfd, reference,
                                                              where):
    ref, _ = reference
    out = run(tmp_path, "run", "fsdp")  # saves steps 3, 6, 9 and 10 (keep_last 3)
    shards = out / "checkpoints" / "step-00000010" / "shards"
    if where == "near the start":
        _flip(shards / "__0_0.distcp", 40)
        damaged = "__0_0.distcp"
    elif where == "in tensor data":
        _flip(shards / "__0_0.distcp", _tensor_data_offset(shards), 0x40)  # x -> ~x * 2**128
        damaged = "__0_0.distcp"
    else:
        _flip(shards / ".metadata", 100)
        damaged = ".metadata"
    capfd.readouterr()
    run(tmp_path, "run", "fsdp")
    err = capfd.readouterr().err
    assert f"checkpoint shard {shards / damaged} does not match its {ALGORITHM}" in err
    assert "skipped damaged checkpoint(s) step-00000010" in err
    assert "resuming from" in err and "step-00000009: step 9" in err
    # Step 10 trained again from the intact step 9: the weights of an uninterrupted run.
    assert_close(weights(out), ref)
    manifest = json.loads((out / "checkpoints" / "step-00000010" / "manifest.json").read_text())
    with open(shards / damaged, "rb") as fh:  # saved again, whole
        assert f"{checksum_stream(fh)[1]:08x}" == manifest["sharded"]["files"][damaged][ALGORITHM]


def test_verify_names_a_missing_a_truncated_and_a_directory_shard(tmp_path):
    storage = LocalStorage()
    (tmp_path / "a").write_bytes(b"x" * 10)
    with open(tmp_path / "a", "rb") as fh:
        size, crc = checksum_stream(fh)
    files = {"a": {"size": size, ALGORITHM: f"{crc:08x}"}}
    verify(storage, str(tmp_path), files)  # intact
    (tmp_path / "a").write_bytes(b"x" * 9)
    with pytest.raises(CheckpointCorrupt, match="has 9 bytes; the manifest says 10"):
        verify(storage, str(tmp_path), files)
    (tmp_path / "a").unlink()
    with pytest.raises(CheckpointCorrupt, match="shard .*a is missing"):
        verify(storage, str(tmp_path), files)
    (tmp_path / "a").mkdir()
    with pytest.raises(CheckpointCorrupt, match="checkpoint shard .*a"):
        verify(storage, str(tmp_path), {"a": {"size": (tmp_path / "a").stat().st_size,
                                              ALGORITHM: "0"}})


def test_each_rank_checks_its_share_of_the_files(tmp_path):
    """Two ranks: file i is read by rank i % 2, so damage is found by exactly one rank."""
    storage = LocalStorage()
    files = {}
    for name in ("f0", "f1"):
        (tmp_path / name).write_bytes(name.encode() * 100)
        with open(tmp_path / name, "rb") as fh:
            size, crc = checksum_stream(fh)
        files[name] = {"size": size, ALGORITHM: f"{crc:08x}"}
    _flip(tmp_path / "f1", 7, 0x01)
    verify(storage, str(tmp_path), files, rank=0, world_size=2)  # f0 only: intact
    with pytest.raises(CheckpointCorrupt, match="f1 does not match"):
        verify(storage, str(tmp_path), files, rank=1, world_size=2)


def test_every_rank_checks_the_index_it_unpickles(tmp_path):
    """``.metadata`` is read by every rank, so every rank checks it, not only rank i % 2."""
    storage = LocalStorage()
    files = {}
    for name in (".metadata", "f1"):
        (tmp_path / name).write_bytes(name.encode() * 100)
        with open(tmp_path / name, "rb") as fh:
            size, crc = checksum_stream(fh)
        files[name] = {"size": size, ALGORITHM: f"{crc:08x}"}
    _flip(tmp_path / ".metadata", 7, 0x01)
    for rank in (0, 1):
        with pytest.raises(CheckpointCorrupt, match=r"\.metadata does not match"):
            verify(storage, str(tmp_path), files, rank=rank, world_size=2)


def test_shard_files_are_checksummed_as_written_not_read_back(tmp_path, monkeypatch):
    """Each rank counts its shard files' CRC-32 while DCP writes them: only the index
    (written by DCP's own pickle, then renamed) is read back; the figures are the files'."""
    from sailfin import Trainer
    from sailfin.checkpoint import shard_checksums
    from tests.recipes import IdData, LinearRecipe, args

    read_back = []

    def counting(stream, *rest):
        read_back.append(getattr(stream, "name", "?"))
        return checksum_stream(stream, *rest)

    monkeypatch.setattr(shard_checksums, "checksum_stream", counting)
    Trainer(LinearRecipe(IdData(40, 0)), args(tmp_path, train_batch_size=10,
                                              checkpoint={"every_n_steps": 2})).train()
    assert read_back and all(str(name).endswith(".metadata") for name in read_back), read_back
    for step in sorted((tmp_path / "checkpoints").glob("step-*")):
        files = json.loads((step / "manifest.json").read_text())["sharded"]["files"]
        for name, entry in files.items():
            with open(step / "shards" / name, "rb") as fh:
                size, crc = checksum_stream(fh)
            assert entry == {"size": size, ALGORITHM: f"{crc:08x}"}
