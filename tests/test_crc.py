"""The CRC-32 every checkpoint, snapshot and shard carries: zlib's values, from the fastest
implementation installed, so files written with one are read with the other."""

import os
import zlib

import pytest
import torch

from sailfin.checkpoint import CheckpointCorrupt
from sailfin.checkpoint.serialize import FileEntry, load_object
from sailfin.checkpoint.storage import LocalStorage
from sailfin.utils import crc


def test_the_fast_implementation_is_the_one_in_use_where_installed():
    pytest.importorskip("isal", reason="isal ships no wheel for this platform")
    assert crc.IMPLEMENTATION == "isal"


@pytest.mark.parametrize("size", [0, 1, 7, 4096, (1 << 20) + 3])
def test_values_are_zlibs_whole_and_chained(size):
    data = os.urandom(size)
    assert crc.crc32(data) == zlib.crc32(data)
    half = size // 2
    assert crc.crc32(data[half:], crc.crc32(data[:half])) == zlib.crc32(data)
    assert crc.crc32(memoryview(data)) == zlib.crc32(data)
    assert crc.crc32(data, 12345) == zlib.crc32(data, 12345)


def test_a_file_saved_with_it_checks_with_zlib_and_damage_is_found(tmp_path):
    path = str(tmp_path / "model.pt")
    torch.save({"w": torch.randn(300_000)}, path)  # an earlier release's trainer.pt
    raw = bytearray(open(path, "rb").read())
    entry = FileEntry.of(raw)
    assert (len(raw), zlib.crc32(raw)) == (entry.size, entry.crc32)
    raw[len(raw) // 2] ^= 0x01  # one bit inside the tensor's data
    open(path, "wb").write(bytes(raw))
    with pytest.raises(CheckpointCorrupt, match="does not match its CRC-32"):
        load_object(LocalStorage(), path, entry)
