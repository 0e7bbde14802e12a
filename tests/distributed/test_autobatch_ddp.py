"""micro_batch_size: auto over 2 DDP processes: the ranks agree on one size."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_ddp import ddp, single


@pytest.mark.slow
@pytest.mark.parametrize("after_first", [False, True])
def test_ranks_agree_on_the_size_only_rank_1_can_hold(tmp_path, after_first):
    """Only rank 1 runs out of memory above 3 samples: both ranks move to 2 (global 16,
    2 ranks: 8, 4, then 2), and the run equals one process with the whole batch."""
    data = {"n_train": 100, "n_val": 0}
    trainer = {"epochs": 2, "train_batch_size": 16, "micro_batch_size": "auto"}
    ref = single(tmp_path, data, {**trainer, "micro_batch_size": 16}, {"momentum": 0.9})
    ranks = ddp(tmp_path, data, trainer, kind="oom",
                recipe={"momentum": 0.9, "limit": 3, "limit_rank": 1,
                        "after_first": after_first})
    for r in ranks:
        assert r["summary"]["micro_batch_size"] == 2
        assert r["summary"]["auto_micro_batch"]["tried"] == [8, 4, 2]
    # Step k sees the same samples: rank 0's part, then rank 1's; each once.
    assert [a + b for a, b in zip(ranks[0]["step_ids"], ranks[1]["step_ids"])] == ref.step_ids
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(ranks[0]["params"][key], value, rtol=1e-5, atol=1e-6)
    for a, b in zip(ranks[0]["trace"], ranks[1]["trace"]):
        assert torch.equal(a, b)
    # Two probing steps use the flat reduce; every later step DDP's own all-reduce.
    assert ranks[0]["allreduce_calls"] == ranks[1]["allreduce_calls"] == 14 - 2
