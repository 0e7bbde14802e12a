"""The benchmarks' helpers: the hand loops fetch what sailfin fetches, and the counts."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import _against  # noqa: E402
import _bytecodes  # noqa: E402
import _callgrind  # noqa: E402
import _hand  # noqa: E402

from sailfin.data.batched import gathered_loader  # noqa: E402
from sailfin.data.plan import BatchPlan  # noqa: E402
from sailfin.data.sampler import ResumableSampler  # noqa: E402


@pytest.mark.parametrize("epoch", [0, 1])
def test_every_hand_loader_yields_sailfins_batches_in_sailfins_order(epoch):
    ds = _hand.make_data(5, batch=8)
    plan = BatchPlan.create(8, 8, 1)
    sampler = ResumableSampler(len(ds), plan, rank=0, seed=_hand.SEED)
    sampler.set_epoch(epoch)
    sailfin = gathered_loader(torch.utils.data.DataLoader(ds, batch_size=8, sampler=sampler),
                              sampler)
    assert type(sailfin.dataset).__name__ == "GatheredTensors"  # sailfin gathers here too
    expected = list(sailfin)
    for make in (_hand.batched_loader, _hand.per_sample_loader, _hand.direct_batches):
        got = list(make(ds, epoch=epoch, batch=8))
        assert len(got) == len(expected) == 5
        for (x, y), (ex, ey) in zip(got, expected):
            assert torch.equal(x, ex) and torch.equal(y, ey)
    assert not torch.equal(expected[0][1], ds.tensors[1][:8])  # shuffled, not in order


def test_the_fingerprint_moves_with_any_weight():
    model = _hand.make_model()
    before = _hand.fingerprint(model)
    assert _hand.fingerprint(_hand.make_model()) == before
    with torch.no_grad():
        list(model.parameters())[-1][3] += 1e-3
    assert _hand.fingerprint(model) != before


def _loop(n):
    total = 0
    for i in range(n):
        total += abs(-i)
    return total


def test_bytecode_counts_grow_with_the_work_and_cancel_the_fixed_part():
    short = _bytecodes.Counts.measure(lambda: _loop(10))
    long = _bytecodes.Counts.measure(lambda: _loop(110))
    assert long.result == sum(range(110))
    step = _bytecodes.per_step(short, long, 100)
    assert step["c_by_name"]["abs"] == 1.0 and step["c_calls"] == 1.0  # one abs per turn
    mine = [v for (path, fn), v in step["by_function"].items() if fn == "_loop"]
    assert mine and 3 <= mine[0] <= 20
    # per-step values are quotients: their sum matches the total's up to rounding
    assert step["opcodes"] == pytest.approx(sum(step["by_function"].values()))
    assert sys.gettrace() is None and sys.getprofile() is None  # the hooks are taken off
    with pytest.raises(ValueError):
        _bytecodes.per_step(short, long, 0)


def test_callgrind_output_is_read_and_fixed_costs_cancel():
    err = "==12== Events    : Ir\n==12== Collected : 123456789\n==12== I refs: 123,456,789\n"
    assert _callgrind.collected(err) == 123456789
    with pytest.raises(ValueError):
        _callgrind.collected("valgrind: no such file")
    assert _callgrind.per_step((100, 1_000_000 + 100 * 7), (300, 1_000_000 + 300 * 7)) == 7
    with pytest.raises(ValueError):
        _callgrind.per_step((300, 1), (100, 2))


def test_own_work_counts_calls_and_lines_of_one_package_only(tmp_path):
    """Calls of the package's functions (generator resumptions included, comprehensions
    that Python 3.12+ inlines left out) and their lines; nothing outside the package."""
    pkg = tmp_path / "ownwork_probe"
    pkg.mkdir()
    (pkg / "mod.py").write_text(
        "def helper(i):\n"
        "    return i + 1\n"
        "\n"
        "def gen(n):\n"
        "    for i in range(n):\n"
        "        yield i\n"
        "\n"
        "def work(n):\n"
        "    total = sum([helper(i) for i in range(n)])\n"
        "    for i in gen(n):\n"
        "        total += i\n"
        "    return total\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import ownwork_probe.mod as mod
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("ownwork_probe", "ownwork_probe.mod"):
            sys.modules.pop(name, None)
    short = _bytecodes.OwnWork.measure(lambda: mod.work(10), str(pkg))
    long = _bytecodes.OwnWork.measure(lambda: [mod.work(30), _loop(100)][0], str(pkg))
    assert long.result == sum(range(1, 31)) + sum(range(30))
    step = _bytecodes.own_per_step(short, long, 20)
    # Per turn: one helper call, one resumption of gen (the final one, which ends it, is
    # fixed); _loop lives outside the package and adds nothing.
    assert step["calls"] == 2.0, step
    assert step["by_function"] == {("ownwork_probe/mod.py", "helper"): 1.0, ("ownwork_probe/mod.py", "gen"): 1.0}
    assert step["lines"] >= 4 and ("ownwork_probe/mod.py", "work") in step["lines_by_function"]
    assert sys.gettrace() is None


def test_against_runs_a_child_on_a_checked_out_rev_and_removes_it():
    """--against's pieces: the rev checked out to a worktree, a child importing sailfin from
    it (its RESULT line read back), the worktree gone afterwards; a child that imported
    another sailfin is refused."""
    import subprocess

    if subprocess.run(["git", "-C", _against.REPO, "rev-parse", "HEAD"],
                      capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    bench = os.path.dirname(_against.__file__)
    def child(first=""):  # `first`: a directory put before PYTHONPATH
        return [sys.executable, "-c", f"import sys; sys.path[:0] = [{bench!r}, {first!r}]; "
                "from _against import say_result; say_result({'steps': 3})"]

    with _against.checkout("HEAD") as tree:
        assert os.path.isfile(os.path.join(tree, "sailfin", "__init__.py"))
        got = _against.run_child(child(), tree)
        assert got["steps"] == 3 and got["sailfin"].startswith(tree)
        with pytest.raises(SystemExit, match="imported sailfin from"):
            _against.run_child(child(_against.REPO), tree)  # another tree's sailfin
    assert not os.path.exists(tree)
    listed = subprocess.run(["git", "-C", _against.REPO, "worktree", "list"],
                            capture_output=True, text=True).stdout
    assert tree not in listed
    with pytest.raises(SystemExit, match="could not check it out"):
        with _against.checkout("no-such-rev-0123456789"):
            pass
