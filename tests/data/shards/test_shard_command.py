"""``sailfin shard SRC_DIR OUT_DIR``."""

from __future__ import annotations

import os

from sailfin.cli import main
from sailfin.data import ShardDataset


def make_tree(root, n=7):
    for i in range(n):
        d = root / ("cats" if i % 2 else "dogs")
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:04d}.cls").write_text(str(i % 2))
        (d / f"{i:04d}.txt").write_text(f"sample {i}")
    (root / "README").write_text("no extension: not a sample")
    (root / ".hidden.txt").write_text("hidden: skipped")


def test_shard_a_tree_grouped_by_basename(tmp_path, capsys):
    make_tree(tmp_path / "src")
    out = tmp_path / "out"
    assert main(["shard", str(tmp_path / "src"), str(out), "--samples-per-shard", "3"]) == 0
    printed = capsys.readouterr().out
    assert "wrote 7 samples into 3 shard(s)" in printed and "skipped 1 file" in printed
    assert sorted(os.listdir(out)) == [f"shard-00000{i}.tar{x}" for i in range(3)
                                       for x in ("", ".idx")]
    ds = ShardDataset(str(out), shuffle=False)
    got = [ds[i] for i in range(len(ds))]
    assert [s["__key__"] for s in got] == [f"cats/{i:04d}" for i in (1, 3, 5)] + \
        [f"dogs/{i:04d}" for i in (0, 2, 4, 6)]
    assert got[0]["txt"] == "sample 1" and got[0]["cls"] == 1


def test_writing_shards_says_how_many_and_how_fast(tmp_path, capsys, monkeypatch):
    from sailfin.utils import progress_line

    monkeypatch.setattr(progress_line, "REPORT_SECONDS", 0.0)  # a line per shard written
    make_tree(tmp_path / "src")
    out = tmp_path / "out"
    assert main(["shard", str(tmp_path / "src"), str(out), "--samples-per-shard", "3"]) == 0
    err = capsys.readouterr().err.splitlines()
    said = [line for line in err if line.startswith(f"sailfin: writing shards into {out}: ")]
    assert [line.split(": ", 2)[2].split(" samples")[0] for line in said] == [
        "3 of 7", "6 of 7", "7 of 7", "7"]
    assert "(43%), 1 shard(s), " in said[0] and said[0].endswith(" samples/s")
    assert ", 3 shard(s), " in said[-1] and said[-1].endswith(" s")


def test_parallel_and_shuffled_sharding(tmp_path, capsys):
    make_tree(tmp_path / "src", n=20)
    one, two = tmp_path / "one", tmp_path / "two"
    args = ["--samples-per-shard", "3", "--shuffle", "5"]
    assert main(["shard", str(tmp_path / "src"), str(one), *args]) == 0
    assert main(["shard", str(tmp_path / "src"), str(two), *args, "--processes", "2"]) == 0
    assert sorted(os.listdir(one)) == sorted(os.listdir(two))
    for name in os.listdir(one):  # the same bytes as one process writes
        assert (one / name).read_bytes() == (two / name).read_bytes()
    keys = [s["__key__"] for s in ShardDataset(str(one), decode="raw", shuffle=False)]
    assert sorted(keys) != keys and len(set(keys)) == 20  # mixed classes, each once


def test_shard_refuses_to_mix_with_existing_shards(tmp_path, capsys):
    make_tree(tmp_path / "src")
    out = str(tmp_path / "out")
    assert main(["shard", str(tmp_path / "src"), out]) == 0
    assert main(["shard", str(tmp_path / "src"), out]) == 2
    err = capsys.readouterr().err  # 1 shard and its index: counted as 1 shard, not 2
    assert f"{out} already holds 1 'shard' shard(s) and 1 index(es); pass --overwrite" in err
    assert main(["shard", str(tmp_path / "src"), out, "--overwrite",
                 "--samples-per-shard", "2"]) == 0
    assert len([n for n in os.listdir(out) if n.endswith(".tar")]) == 4
    assert main(["shard", str(tmp_path / "nope"), out]) == 2
    assert main(["shard", str(tmp_path / "src"), out, "--bogus"]) == 2
