"""The benchmarks' helpers: the hand loops fetch what sailfin fetches, and the counts."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
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
