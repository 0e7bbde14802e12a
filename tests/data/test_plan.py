import numpy as np
import pytest
import torch

from sailfin.config import ConfigError
from sailfin.data import BatchPlan, ResumableSampler, epoch_order
from sailfin.data.sampler import EvalSampler


def test_accumulation_from_global_batch():
    plan = BatchPlan.create(64, 16, 2)
    assert plan.accumulation == 2
    assert BatchPlan.create(64, None, 2).micro_batch == 32


def test_indivisible_batch_names_values_that_work():
    with pytest.raises(ConfigError) as err:
        BatchPlan.create(100, 16, 1)
    msg = str(err.value)
    assert "train_batch_size=100" in msg and "16 x 1 = 16" in msg
    assert "micro_batch_size" in msg and "train_batch_size 96 or 112" in msg
    for m in (20, 10, 25):  # each suggestion must actually divide
        assert BatchPlan.create(100, m, 1)
    with pytest.raises(ConfigError, match="does not split over 3 devices"):
        BatchPlan.create(64, None, 3)


@pytest.mark.parametrize("n,drop_last,expected", [(100, False, 2), (100, True, 1),
                                                  (128, False, 2), (127, True, 1)])
def test_steps_in_epoch(n, drop_last, expected):
    assert BatchPlan.create(64, 32, 1, drop_last).steps_in_epoch(n) == expected


def test_max_steps_per_epoch_caps():
    assert BatchPlan.create(10, 10, 1, max_steps_per_epoch=3).steps_in_epoch(100) == 3


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("n", [43, 64, 5, 1])
def test_micro_batches_cover_the_step_and_weights_sum_to_world(world, n):
    plan = BatchPlan.create(8 * world, 4, world)  # accumulation 2
    for step in range(plan.steps_in_epoch(n)):
        start, stop = plan.step_positions(step, n)
        covered, weight_sum = [], 0.0
        counts = set()
        for rank in range(world):
            lo, hi, pad = plan.rank_positions(step, n, rank)
            micros = plan.micro_batches(step, n, rank)
            counts.add(len(micros))
            assert micros[-1].last and not any(m.last for m in micros[:-1])
            real = [m for m in micros if not m.padding]
            assert [m.padding for m in micros] == [False] * len(real) + [pad] * pad
            if pad:
                assert (micros[-1].count, micros[-1].weight) == (1, 0.0)
            assert sum(m.count for m in real) == hi - lo
            assert all(0 < m.count <= plan.micro_batch for m in real)
            covered.extend(range(lo, hi))
            weight_sum += sum(m.weight for m in micros)
        assert covered == list(range(start, stop))
        assert len(counts) == 1  # every rank runs the same forwards
        # DDP divides the summed gradient by the world size: weights must add to W.
        assert weight_sum == pytest.approx(world)


def test_uneven_last_step_splits_22_21():
    plan = BatchPlan.create(64, 32, 2)
    assert [plan.rank_positions(0, 43, r)[:2] for r in range(2)] == [(0, 22), (22, 43)]


def test_order_is_a_pure_function_of_seed_and_epoch():
    a, b = epoch_order(50, 1, 0), epoch_order(50, 1, 0)
    assert (a == b).all() and sorted(a.tolist()) == list(range(50))
    assert not (epoch_order(50, 1, 1) == a).all()
    assert not (epoch_order(50, 2, 0) == a).all()
    assert epoch_order(5, 1, 0, shuffle=False).tolist() == list(range(5))


def _rank_streams(n, world, micro, global_batch, epoch=0, start_step=0, seed=3):
    plan = BatchPlan.create(global_batch, micro, world)
    out = []
    for rank in range(world):
        s = ResumableSampler(n, plan, rank, seed)
        s.set_epoch(epoch, start_step)
        out.append(list(s))
        assert len(s) == len(out[-1])
    return plan, out


def _steps(plan, stream, n, rank):
    """Split a rank's stream into (real ids, padding ids) per step."""
    pos, out = 0, []
    for step in range(plan.steps_in_epoch(n)):
        lo, hi, pad = plan.rank_positions(step, n, rank)
        out.append((stream[pos:pos + hi - lo], stream[pos + hi - lo:pos + hi - lo + pad]))
        pos += hi - lo + pad
    assert pos == len(stream)
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("n", [101, 100, 7])
def test_exactly_once_per_epoch_across_ranks(world, n):
    plan, streams = _rank_streams(n, world, 5, 20)
    ids = [i for r, s in enumerate(streams) for chunk, _ in _steps(plan, s, n, r)
           for i in chunk]
    assert sorted(ids) == list(range(n))


@pytest.mark.parametrize("world,micro,g,n", [(2, 4, 16, 57), (4, 1, 4, 3), (2, 16, 64, 33),
                                             (3, 2, 12, 50), (2, 5, 20, 101)])
def test_same_micro_batch_count_on_every_rank_padding_with_the_steps_first_sample(
        world, micro, g, n):
    """The DataLoader cuts each rank's stream into micro-batches of `micro`: the padding
    sample must land in a micro-batch of its own, and every rank gets as many."""
    plan, streams = _rank_streams(n, world, micro, g)
    order = epoch_order(n, 3, 0).tolist()
    for step in range(plan.steps_in_epoch(n)):
        loader_counts = set()
        for r, s in enumerate(streams):
            real, pad = _steps(plan, s, n, r)[step]
            micros = plan.micro_batches(step, n, r)
            chunks = [real[i:i + micro] for i in range(0, len(real), micro)] + (
                [pad] if pad else [])
            assert [len(c) for c in chunks] == [m.count for m in micros]
            loader_counts.add(len(chunks))
            assert pad in ([], [order[step * g]])
        assert len(loader_counts) == 1


@pytest.mark.parametrize("world,micro", [(1, 20), (2, 5), (4, 5), (2, 10)])
def test_step_k_sees_the_same_samples_whatever_the_world(world, micro):
    n, g = 101, 20
    order = epoch_order(n, 3, 0).tolist()
    plan, streams = _rank_streams(n, world, micro, g)
    per_rank = [_steps(plan, s, n, r) for r, s in enumerate(streams)]
    for step in range(plan.steps_in_epoch(n)):
        got = [i for r in range(world) for i in per_rank[r][step][0]]
        assert got == order[step * g:(step + 1) * g]  # contiguous split: rank order = order


def test_resume_start_step_yields_the_tail():
    _, full = _rank_streams(101, 2, 5, 20)
    _, tail = _rank_streams(101, 2, 5, 20, start_step=3)
    for r in range(2):
        assert full[r][-len(tail[r]):] == tail[r]
        assert len(full[r]) - len(tail[r]) == 3 * 10


def test_padding_when_fewer_samples_than_ranks():
    plan, streams = _rank_streams(3, 4, 1, 4)
    assert [len(s) for s in streams] == [1, 1, 1, 1]
    assert plan.micro_batches(0, 3, 3)[0].weight == 0.0
    assert plan.micro_batches(0, 3, 3)[0].padding
    assert streams[3] == streams[0]  # the step's first sample


def test_eval_sampler_is_contiguous_and_in_order():
    shares = [list(EvalSampler(10, r, 3)) for r in range(3)]
    assert shares == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert [list(EvalSampler(1, r, 2)) for r in range(2)] == [[0], []]


@pytest.mark.parametrize("world,micro,g", [(1, 4, 12), (2, 4, 24), (3, 2, 36), (2, 16, 32),
                                           (4, 3, 48)])
def test_weighted_micro_gradients_equal_the_one_big_batch_gradient(world, micro, g):
    """Invariant 1 in arithmetic: rank-averaged weighted micro-gradients == full gradient."""
    torch.manual_seed(0)
    n = 43  # a short last step, short micro-batches, and (world 4) uneven rank shares
    plan = BatchPlan.create(g, micro, world)
    x, y = torch.randn(n, 3), torch.randn(n)
    w = torch.randn(3, requires_grad=True)

    def grad_of(idx, weight=1.0):
        w.grad = None
        (weight * ((x[idx] @ w - y[idx]) ** 2).mean()).backward()
        return w.grad.clone()

    for step in range(plan.steps_in_epoch(n)):
        start, stop = plan.step_positions(step, n)
        full = grad_of(list(range(start, stop)))
        total = torch.zeros(3)
        for rank in range(world):
            lo, hi, pad = plan.rank_positions(step, n, rank)
            pos = lo
            for m in plan.micro_batches(step, n, rank):
                if m.padding:  # the step's first sample, weight 0: adds nothing
                    total += grad_of([start], m.weight)
                    continue
                total += grad_of(list(range(pos, pos + m.count)), m.weight)
                pos += m.count
            assert pos == hi
        torch.testing.assert_close(total / world, full)  # DDP averages over ranks


def test_world_size_that_cannot_realise_the_batch_lists_those_that_can():
    with pytest.raises(ConfigError, match="a world size of 1, 2, 4$"):
        BatchPlan.create(64, 16, 3)


@pytest.mark.parametrize("n, g, start, drop_last, cap", [
    (47, 10, 0, False, None), (47, 10, 3, False, None), (47, 10, 2, True, None),
    (47, 10, 1, False, 3), (40, 10, 4, False, None), (5, 10, 0, False, None)])
def test_one_rank_fast_path_equals_the_per_step_split(n, g, start, drop_last, cap):
    plan = BatchPlan.create(g, 5, 1, drop_last, cap)
    sampler = ResumableSampler(n, plan, rank=0, seed=3)
    sampler.set_epoch(2, start_step=start)
    order = sampler.epoch_order()
    per_step = [i for lo, hi in sampler._ranges() for i in order[lo:hi].tolist()]
    assert list(sampler) == per_step and len(sampler) == len(per_step)


def test_step_indices_follow_the_dataset_order():
    """A dataset with its own epoch order (shards): the non-finite report names its samples."""
    plan = BatchPlan.create(4, 4, 1)

    def reversed_order(seed, epoch):
        return np.arange(10)[::-1]

    sampler = ResumableSampler(10, plan, seed=0, order=reversed_order)
    assert sampler.step_indices(0, 1) == [5, 4, 3, 2]


# -- gpu_batch_size_limit: PyMarlin's ceiling ---------------------------------------------
@pytest.mark.parametrize("global_batch, world, limit, micro", [
    (64, 1, 64, 64), (64, 2, 64, 32),    # a limit above the share: no accumulation
    (96, 1, 40, 32), (100, 1, 16, 10),   # the largest divisor within the limit
    (64, 2, 512, 32),                    # PyMarlin's default limit
    (30, 4, 8, None)])                   # 30 does not split over 4
def test_gpu_batch_size_limit_is_a_ceiling(global_batch, world, limit, micro):
    from sailfin.data.plan import largest_micro_batch
    if micro is None:
        with pytest.raises(ConfigError, match="train_batch_size=30 does not split over 4 "
                                              "devices, whatever the micro batch: use "
                                              "train_batch_size 28 or 32"):
            largest_micro_batch(global_batch, world, limit)
        return
    plan = BatchPlan.create(global_batch, None, world, micro_batch_limit=limit)
    assert plan.micro_batch == micro and plan.micro_batch <= limit
    assert plan.accumulation * micro * world == global_batch


def test_the_digits_demo_config_plans_on_two_processes():
    """README: torchrun --nproc-per-node 2 -m sailfin train examples/digits/config.yaml."""
    from sailfin.config import load_config
    trainer = load_config("examples/digits/config.yaml").trainer
    plan = BatchPlan.create(trainer.train_batch_size, trainer.micro_batch_size, 2,
                            micro_batch_limit=trainer.gpu_batch_size_limit)
    assert (plan.micro_batch, plan.accumulation) == (32, 1)
    one = BatchPlan.create(trainer.train_batch_size, trainer.micro_batch_size, 1,
                           micro_batch_limit=trainer.gpu_batch_size_limit)
    assert (one.micro_batch, one.accumulation) == (64, 1)


def test_divisor_suggestion_names_the_ceiling_too():
    with pytest.raises(ConfigError, match=r"use micro_batch_size 10 or 20 or 25 \(or "
                                          r"gpu_batch_size_limit 16: the largest micro batch "
                                          r"within it\), or train_batch_size 96 or 112"):
        BatchPlan.create(100, 16, 1)


@pytest.mark.parametrize("world", [2, 4])
def test_a_micro_batch_above_a_ranks_share_is_lowered_to_it_with_one_line(world):
    """micro = global (one device's natural setting) on several ranks: lowered to the
    share; the plan, so each step's samples and weights, is the share's plan."""
    said = []
    plan = BatchPlan.create(32, 32, world, note=said.append)
    assert plan == BatchPlan.create(32, 32 // world, world)
    assert plan.global_batch == 32 and plan.accumulation == 1
    assert said == [f"trainer.micro_batch_size 32 is more than each of the {world} "
                    f"process(es)' share of trainer.train_batch_size 32: lowered to "
                    f"{32 // world} (the global batch, and so the result, unchanged)"]
    for rank in range(world):
        assert plan.micro_batches(0, 100, rank) == \
            BatchPlan.create(32, 32 // world, world).micro_batches(0, 100, rank)
    quiet = []
    assert BatchPlan.create(32, 16, 2, note=quiet.append).micro_batch == 16  # fits: as is
    assert BatchPlan.create(32, 32, 1, note=quiet.append).micro_batch == 32
    assert quiet == []
    with pytest.raises(ConfigError, match="is not a multiple of"):
        BatchPlan.create(32, 32, 3)  # no whole share to lower to: refused, as before
