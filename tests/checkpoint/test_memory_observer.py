"""Observing never changes a run: with memory snapshots every step (also persisted every
N steps, also beside async disk saves) the final weights are bit-identical to the same run
without snapshots, under sp, fsdp (one process) and sp-dp, with AdamW."""

import pytest
import torch

from tests.checkpoint.memory_observer import VARIANTS, train

_REFERENCE: dict = {}


def reference(tmp_path_factory, backend):
    if backend not in _REFERENCE:
        _REFERENCE[backend] = train(tmp_path_factory.mktemp(f"ref-{backend}"), backend, None)
    return _REFERENCE[backend]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("backend", ["sp", "fsdp", "sp-dp"])
def test_snapshots_leave_the_weights_bit_identical(tmp_path, tmp_path_factory, backend,
                                                   variant):
    want = reference(tmp_path_factory, backend)
    got = train(tmp_path, backend, variant)
    # AdamW stepped exactly once per optimizer step (10 steps), with and without.
    assert want["steps"] == got["steps"] == [10.0]
    assert got["weights"].keys() == want["weights"].keys()
    for key, value in want["weights"].items():
        assert torch.equal(got["weights"][key], value), f"{key} changed by the snapshots"
