"""``final/hf`` re-exported with a kill at each step: the directory a user loads is the
previous export whole, the new one whole, or absent between the two renames; never a
half-deleted mixture (which ``from_pretrained`` loaded with a 5-token tokenizer). The
next export removes what a killed one left."""

import os
import shutil

import pytest

from sailfin.hf import export
from sailfin.hf.export import remove_stale, replace_dir

FILES = ("config.json", "model.safetensors", "tokenizer.json", "vocab.txt")


def write(path, version):
    os.makedirs(path)
    for name in FILES:
        with open(os.path.join(path, name), "w") as fh:
            fh.write(version)


def version(path):
    """'old' or 'new' for a complete export, None when absent; fails on a mixture."""
    if not os.path.exists(path):
        return None
    found = {name: open(os.path.join(path, name)).read()
             for name in os.listdir(path)}
    assert sorted(found) == sorted(FILES) and len(set(found.values())) == 1, found
    return next(iter(found.values()))


def killed_at(step, new, out_dir):
    """Run replace_dir in a child process that dies (os._exit, as kill -9) at ``step``."""
    pid = os.fork()
    if pid == 0:  # the child: no pytest clean-up, no atexit
        try:
            rename = os.rename

            def dying_rename(src, dst):
                if (step == "rename aside" and src == out_dir) or (
                        step == "rename in" and src == new):
                    os._exit(9)
                rename(src, dst)

            def dying_rmtree(path, ignore_errors=False):
                if step == "delete" and ".old-" in path and os.path.exists(path):
                    os.remove(os.path.join(path, sorted(os.listdir(path))[0]))
                    os._exit(9)  # part-way through deleting the old export
                shutil_rmtree(path, ignore_errors=ignore_errors)

            shutil_rmtree = shutil.rmtree
            os.rename = dying_rename
            export.shutil.rmtree = dying_rmtree
            replace_dir(new, out_dir)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.parametrize("first, step, code, expected", [
    (False, "rename aside", 9, "old"),
    (False, "rename in", 9, None),   # between the renames: none, never a mixture
    (False, "delete", 9, "new"),     # the old one half-deleted, aside: not loaded
    (False, None, 0, "new"),
    (True, "rename in", 9, None),    # a first export: nothing to set aside
    (True, None, 0, "new"),
])
def test_a_kill_at_each_step_leaves_a_whole_export_and_the_next_one_cleans(
        tmp_path, first, step, code, expected):
    out_dir = str(tmp_path / "final" / "hf")
    if not first:
        write(out_dir, "old")
    new = f"{out_dir}.tmp-999999999"  # a writer that is gone
    write(new, "new")
    assert killed_at(step, new, out_dir) == code
    assert version(out_dir) == expected, os.listdir(tmp_path / "final")
    # The next export: the stale siblings of dead processes go, the new export is whole.
    write(f"{out_dir}.tmp-{os.getpid()}-x", "new")  # not a pid: not ours to remove
    again = str(tmp_path / "final" / "next")
    write(again, "new")
    remove_stale(out_dir)
    replace_dir(again, out_dir)
    assert version(out_dir) == "new"
    left = sorted(os.listdir(tmp_path / "final"))
    assert left == ["hf", f"hf.tmp-{os.getpid()}-x"], left


def test_a_live_writers_temporary_is_left_alone(tmp_path):
    out_dir = str(tmp_path / "hf")
    live = f"{out_dir}.tmp-1"  # pid 1 is alive (and not this process)
    write(live, "new")
    assert remove_stale(out_dir) == []
    assert os.path.exists(live)
