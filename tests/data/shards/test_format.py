"""Writing shards, their indexes, plain WebDataset tars, shard lists and codecs."""

from __future__ import annotations

import io
import os
import pickle
import tarfile

import numpy as np
import pytest
import torch

from sailfin.data import ShardDataset, ShardWriter
from sailfin.data.shards import ShardIndex, expand_urls
from sailfin.data.shards.remote import expand_braces

from .helpers import sample, write_shards


def test_writer_names_shards_and_writes_an_index_beside_each(tmp_path):
    with ShardWriter(str(tmp_path), samples_per_shard=4) as writer:
        for i in range(10):
            writer.write(sample(i))
    assert [os.path.basename(p) for p in writer.shards] == \
        ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    assert sorted(os.listdir(tmp_path)) == sorted(
        n for p in writer.shards for n in (os.path.basename(p), os.path.basename(p) + ".idx"))
    # Standard tar: the tar module lists the WebDataset member names.
    with tarfile.open(writer.shards[2]) as tar:
        assert tar.getnames() == ["000008.cls", "000008.x.npy", "000009.cls", "000009.x.npy"]
    index = ShardIndex.from_json((tmp_path / "shard-000002.tar.idx").read_bytes(), "idx")
    assert index.keys == ["000008", "000009"] and index.exts == ("cls", "x.npy")
    assert index.tar_bytes == os.path.getsize(writer.shards[2])
    ds = ShardDataset(str(tmp_path))
    assert len(ds) == 10
    got = ds[9]
    assert got["__key__"] == "000009" and got["cls"] == 9
    np.testing.assert_array_equal(got["x.npy"], sample(9)["x.npy"])


def test_same_samples_give_byte_identical_shards(tmp_path):
    a, b = write_shards(tmp_path / "a", [3]), write_shards(tmp_path / "b", [3])
    assert open(a[0], "rb").read() == open(b[0], "rb").read()


def test_an_error_while_writing_discards_only_the_unfinished_shard(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(str(tmp_path), samples_per_shard=2) as writer:
            for i in range(3):
                writer.write(sample(i))
            raise RuntimeError("boom")
    assert sorted(os.listdir(tmp_path)) == ["shard-000000.tar", "shard-000000.tar.idx"]
    assert len(ShardDataset(str(tmp_path))) == 2


def test_writer_rejects_bad_samples(tmp_path):
    with ShardWriter(str(tmp_path), samples_per_shard=5) as writer:
        with pytest.raises(ValueError, match="__key__"):
            writer.write({"cls": 1})
        with pytest.raises(ValueError, match="dot"):
            writer.write({"__key__": "a.b", "cls": 1})
        with pytest.raises(TypeError, match="sample 'k', field 'bin'.*object"):
            writer.write({"__key__": "k", "bin": object()})
        writer.write({"__key__": "k", "cls": 1})
        with pytest.raises(ValueError, match="appears twice"):
            writer.write({"__key__": "k", "cls": 2})


def test_parallel_writers_with_start_indexes_match_one_writer(tmp_path):
    with ShardWriter(str(tmp_path / "one"), samples_per_shard=3) as w:
        for i in range(10):
            w.write(sample(i))
    for part, (lo, hi) in enumerate([(0, 6), (6, 10)]):  # as two processes would
        with ShardWriter(str(tmp_path / "two"), samples_per_shard=3,
                         start_index=lo // 3) as w:
            for i in range(lo, hi):
                w.write(sample(i))
    for name in os.listdir(tmp_path / "one"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


def _plain_tar(path, members, fmt=tarfile.USTAR_FORMAT):
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_plain_webdataset_tars_are_indexed_on_first_read(tmp_path):
    long_dir = "d" * 120  # past ustar's 100-character name field
    _plain_tar(tmp_path / "gnu.tar", [(f"{long_dir}/a.cls", b"1"), (f"{long_dir}/a.txt", b"hi"),
                                      ("b.cls", b"2"), ("README", b"not a sample")],
               tarfile.GNU_FORMAT)
    _plain_tar(tmp_path / "pax.tar", [("c.cls", b"3"), ("c.json", b'{"v": 1}')],
               tarfile.PAX_FORMAT)
    ds = ShardDataset([str(tmp_path / "gnu.tar"), str(tmp_path / "pax.tar")], shuffle=False)
    assert [ds[i]["__key__"] for i in range(3)] == [f"{long_dir}/a", "b", "c"]
    assert ds[0]["txt"] == "hi" and ds[2]["json"] == {"v": 1}
    assert (tmp_path / "gnu.tar.idx").exists()  # kept beside the shard for next time
    # The kept index is the one a fresh scan gives, and it is used as is next time.
    again = ShardDataset(str(tmp_path / "gnu.tar"))
    assert again.indexes[0].to_json() == ds.indexes[0].to_json()


def test_a_read_only_shard_directory_keeps_its_index_in_the_cache(tmp_path, monkeypatch):
    _plain_tar(tmp_path / "s.tar", [("a.cls", b"1"), ("b.cls", b"2")])

    def read_only(self, path):  # as writing into a read-only directory fails (even for root)
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(ShardIndex, "save", read_only)
    cache = tmp_path / "cache"
    ds = ShardDataset(str(tmp_path / "s.tar"), cache_dir=str(cache))
    assert len(ds) == 2 and not (tmp_path / "s.tar.idx").exists()
    (kept,) = [n for n in os.listdir(cache) if n.endswith(".idx")]
    # The next run finds it there instead of scanning the tar again.
    monkeypatch.setattr("sailfin.data.shards.index._scan", None)
    assert len(ShardDataset(str(tmp_path / "s.tar"), cache_dir=str(cache))) == 2


def test_brace_glob_directory_and_list_notations(tmp_path):
    assert expand_braces("s-{000008..000011}.tar") == [
        "s-000008.tar", "s-000009.tar", "s-000010.tar", "s-000011.tar"]
    assert expand_braces("{a,b}/x{1..2}") == ["a/x1", "a/x2", "b/x1", "b/x2"]
    assert expand_braces("{a,{b,c}}{x}") == ["a{x}", "b{x}", "c{x}"]
    with pytest.raises(ValueError, match="unbalanced"):
        expand_braces("s-{1..2.tar")
    paths = write_shards(tmp_path, [2, 2, 2])
    assert expand_urls(str(tmp_path)) == paths
    assert expand_urls(str(tmp_path / "*.tar")) == paths
    assert expand_urls(str(tmp_path / "shard-{000001..000002}.tar")) == paths[1:]
    assert expand_urls([paths[2], paths[0]]) == [paths[2], paths[0]]
    with pytest.raises(ValueError, match="listed twice"):
        expand_urls([paths[0], paths[0]])
    with pytest.raises(ValueError, match="matches no shard"):
        expand_urls(str(tmp_path / "nope-*.tar"))
    with pytest.raises(ValueError, match="empty"):
        expand_urls([])


def test_missing_shards_and_empty_lists_fail_at_start_up(tmp_path):
    write_shards(tmp_path, [2])
    with pytest.raises(Exception, match=r"shard .*shard-000001.tar does not exist"):
        ShardDataset(str(tmp_path / "shard-{000000..000001}.tar"))
    with pytest.raises(ValueError, match="empty"):
        ShardDataset([])


def test_pipe_urls_are_refused_unless_allowed(tmp_path):
    (path,) = write_shards(tmp_path, [3])
    os.unlink(path + ".idx")
    url = f"pipe:cat {path}"
    with pytest.raises(ValueError, match="pipe:.*runs a shell command.*allow_pipe=True"):
        ShardDataset(url)
    ds = ShardDataset(url, allow_pipe=True, cache_dir=str(tmp_path / "cache"), fields=("cls",))
    assert [ds[i][0] for i in range(3)] == [0, 1, 2]


def test_codecs_round_trip_by_extension(tmp_path):
    pytest.importorskip("PIL")
    from PIL import Image

    image = (np.arange(4 * 5 * 3) % 256).astype(np.uint8).reshape(4, 5, 3)
    gray = (np.arange(20) * 9).astype(np.uint8).reshape(4, 5)
    with ShardWriter(str(tmp_path), samples_per_shard=10) as writer:
        writer.write({"__key__": "s", "png": image, "gray.png": gray, "jpg": image,
                      "pil.png": Image.fromarray(image), "txt": "héllo", "cls": 3,
                      "json": {"a": [1, 2]}, "x.npy": torch.arange(3), "bin": b"\x00\x01",
                      "w.pth": {"w": torch.ones(2)}, "pyd": b"pickled?"})
    got = ShardDataset(str(tmp_path))[0]
    np.testing.assert_array_equal(got["png"], image)
    np.testing.assert_array_equal(got["gray.png"], gray)
    np.testing.assert_array_equal(got["pil.png"], image)
    assert got["jpg"].shape == (4, 5, 3)  # lossy
    assert got["txt"] == "héllo" and got["cls"] == 3 and got["json"] == {"a": [1, 2]}
    np.testing.assert_array_equal(got["x.npy"], [0, 1, 2])
    assert got["bin"] == b"\x00\x01" and got["pyd"] == b"pickled?"  # never unpickled
    assert torch.equal(got["w.pth"]["w"], torch.ones(2))
    pil = ShardDataset(str(tmp_path), decode="pil", fields=("png",))[0][0]
    assert pil.size == (5, 4)
    raw = ShardDataset(str(tmp_path), decode="raw")[0]
    assert raw["cls"] == b"3"
    custom = ShardDataset(str(tmp_path), decode=lambda s: (s["__key__"], int(s["cls"])),
                          transform=lambda t: t[1] * 10)
    assert custom[0] == 30
    with pytest.raises(ValueError, match="did you mean 'numpy'"):
        ShardDataset(str(tmp_path), decode="nupmy")


def test_the_dataset_pickles_without_its_open_files(tmp_path):
    write_shards(tmp_path, [3, 3])
    ds = ShardDataset(str(tmp_path), fields=("cls",))
    assert ds[4] == (4,)  # opens a descriptor
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._fds == {} and clone[5] == (5,) and len(clone) == 6
    (fd,) = ds._fds.values()
    ds.close()
    with pytest.raises(OSError):
        os.fstat(fd)
    assert ds[0] == (0,)  # reopens
