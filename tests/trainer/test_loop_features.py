"""val_every_n_steps, early stopping, EMA weights, FLOPs/MFU."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from sailfin import Callback, DataInterface, ModuleInterface, Trainer
from sailfin.config import ConfigError, TrainerArguments
from sailfin.trainer.features.flops import FlopsMeter, device_peak_tflops
from tests.recipes import IdData, LinearRecipe, args


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def val_steps(module):
    return [e[1] for e in module.events if e[0] == "val"]


# -- validation every N steps ------------------------------------------------------------
def test_validation_every_n_steps_and_at_epoch_ends(tmp_path):
    """10 steps an epoch, 2 epochs, every 3 steps: 3 6 9 | 10 (epoch end) | 12 15 18 | 20."""
    module = LinearRecipe(IdData(100, 12))
    summary = Trainer(module, args(tmp_path, epochs=2, val_every_n_steps=3,
                                   checkpoint={"best_metric": "mse", "keep_last": None})).train()
    assert val_steps(module) == [3, 6, 9, 10, 12, 15, 18, 20]
    val = [e for e in read_jsonl(tmp_path / "metrics.jsonl") if e["split"] == "val"]
    assert [(e["step"], e["epoch"]) for e in val] == [(3, 1), (6, 1), (9, 1), (10, 1),
                                                      (12, 2), (15, 2), (18, 2), (20, 2)]
    # A step validation that improves the best metric saves the best checkpoint at once.
    best = summary["best"]
    assert best["metric"] == "mse" and best["step"] in (3, 6, 9, 10, 12, 15, 18, 20)
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert "step-00000003" in saved  # the first validation is always the best so far
    assert f"step-{best['step']:08d}" in saved


def test_only_step_validation_still_validates_the_end(tmp_path):
    module = LinearRecipe(IdData(100, 12))
    Trainer(module, args(tmp_path, epochs=1, val_every_n_steps=4, val_every_n_epochs=0)).train()
    assert val_steps(module) == [4, 8, 10]


def test_step_validation_schedule_survives_resume(tmp_path):
    first = LinearRecipe(IdData(100, 12))
    Trainer(first, args(tmp_path, epochs=2, max_steps=5, val_every_n_steps=3,
                        checkpoint={"every_n_steps": 5})).train()
    assert val_steps(first) == [3, 5]  # 5: max_steps ended the run: the final model
    again = LinearRecipe(IdData(100, 12))
    Trainer(again, args(tmp_path, epochs=2, val_every_n_steps=3,
                        checkpoint={"every_n_steps": 5})).train()
    assert val_steps(again) == [6, 9, 10, 12, 15, 18, 20]


def test_val_every_n_steps_is_checked():
    with pytest.raises(ConfigError, match="trainer.val_every_n_steps"):
        TrainerArguments(val_every_n_steps=0)


# -- early stopping ------------------------------------------------------------------------
def test_run_stops_early_says_why_and_saves_as_at_the_end(tmp_path, caplog):
    """lr 0: the validation loss never improves; patience 2 stops at the third validation."""
    def run():
        module = LinearRecipe(IdData(100, 12), lr=0.0)
        trainer = Trainer(module, args(tmp_path, epochs=5, val_every_n_steps=2,
                                       early_stopping={"metric": "mse", "patience": 2}))
        return module, trainer.train()

    with caplog.at_level(logging.INFO, logger="sailfin"):
        module, summary = run()
    assert summary["global_step"] == 6 and val_steps(module) == [2, 4, 6]
    stopped = json.loads((tmp_path / "summary.json").read_text())["stopped_early"]
    assert stopped["step"] == 6 and stopped["metric"] == "mse"
    assert "early stopping: mse did not improve" in stopped["reason"]
    assert "early stopping: mse did not improve" in caplog.text
    assert (tmp_path / "final" / "model.safetensors").is_file()
    assert (tmp_path / "checkpoints" / "step-00000006").is_dir()  # the end-of-run checkpoint
    # Its state is in that checkpoint: running again resumes there and stops at once.
    module, summary = run()
    assert summary["global_step"] == 6 and val_steps(module) == []
    assert summary["stopped_early"]["step"] == 6


def test_early_stopping_counts_validations_without_improvement(tmp_path):
    module = LinearRecipe(IdData(100, 12))  # learns: mse falls at every validation
    summary = Trainer(module, args(tmp_path, epochs=3, val_every_n_steps=5,
                                   early_stopping={"metric": "mse", "patience": 1})).train()
    assert summary["stopped_early"] is None and summary["global_step"] == 30


def test_early_stopping_metric_that_is_not_reported(tmp_path):
    module = LinearRecipe(IdData(100, 12))
    with pytest.raises(ConfigError, match="trainer.early_stopping.metric 'mae'"):
        Trainer(module, args(tmp_path, early_stopping={"metric": "mae"})).train()


@pytest.mark.parametrize("bad, match", [({"patience": 0, "metric": "x"}, "patience"),
                                        ({"mode": "up", "metric": "x"}, "mode"),
                                        ({"min_delta": -1.0, "metric": "x"}, "min_delta")])
def test_early_stopping_config_is_checked(bad, match):
    with pytest.raises(ConfigError, match=f"trainer.early_stopping.{match}"):
        TrainerArguments(early_stopping=bad)


# -- EMA -------------------------------------------------------------------------------------
class RecordWeights(Callback):
    def __init__(self):
        self.after_step = []

    def on_step_end(self, trainer):
        self.after_step.append({k: v.detach().clone()
                                for k, v in trainer.module.named_parameters()})


def expected_ema(initial, after_step, decay, every, warmup=False):
    ema = {k: v.clone() for k, v in initial.items()}
    n = 0
    for step, weights in enumerate(after_step, start=1):
        if step % every == 0:
            d = min(decay, (1 + n) / (10 + n)) if warmup else decay
            ema = {k: d * ema[k] + (1 - d) * weights[k] for k in ema}
            n += 1
    return ema


@pytest.mark.parametrize("every, warmup", [(1, False), (3, False), (1, True)])
def test_ema_matches_an_average_computed_here(tmp_path, every, warmup):
    module = LinearRecipe(IdData(100, 12), momentum=0.9)
    initial = {k: v.detach().clone() for k, v in module.named_parameters()}
    record = RecordWeights()
    trainer = Trainer(module, args(tmp_path, epochs=2, ema={"decay": 0.8, "every_n_steps": every,
                                                             "warmup": warmup}),
                      callbacks=[record])
    summary = trainer.train()
    want = expected_ema(initial, record.after_step, 0.8, every, warmup)
    saved = load_file(str(tmp_path / "final" / "ema.safetensors"))
    model = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert set(saved) == set(model)  # the same names as the model's weights
    for k, v in want.items():
        torch.testing.assert_close(saved[k], v, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model[k], record.after_step[-1][k])  # trained, not EMA
    assert summary["ema"]["updates"] == 20 // every


def test_ema_validation_uses_the_average_and_puts_the_weights_back(tmp_path):
    data = IdData(100, 12)
    module = LinearRecipe(data)
    Trainer(module, args(tmp_path, epochs=2, ema={"decay": 0.9, "validate": True})).train()
    ema = load_file(str(tmp_path / "final" / "ema.safetensors"))
    trained = {k: v.detach().clone() for k, v in module.state_dict().items()}
    _, x, y = data.val[list(range(12))]
    with torch.no_grad():
        want = ((x @ ema["linear.weight"].T).squeeze(-1) + ema["linear.bias"] - y).pow(2).mean()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["val"]["mse"] == pytest.approx(want.item(), rel=1e-5)
    assert not torch.equal(trained["linear.weight"], ema["linear.weight"])
    torch.testing.assert_close(load_file(str(tmp_path / "final" / "model.safetensors"))
                               ["linear.weight"], trained["linear.weight"])


def test_ema_is_in_the_checkpoint_and_resumes(tmp_path):
    whole = LinearRecipe(IdData(100, 12))
    Trainer(whole, args(tmp_path / "whole", epochs=2, ema={"decay": 0.7})).train()
    ckpt = {"at_epoch_end": False, "every_n_steps": 7}
    first = LinearRecipe(IdData(100, 12))
    Trainer(first, args(tmp_path / "cut", epochs=2, max_steps=7, ema={"decay": 0.7},
                        checkpoint=ckpt)).train()
    second = LinearRecipe(IdData(100, 12))
    Trainer(second, args(tmp_path / "cut", epochs=2, ema={"decay": 0.7},
                         checkpoint=ckpt)).train()
    want = load_file(str(tmp_path / "whole" / "final" / "ema.safetensors"))
    got = load_file(str(tmp_path / "cut" / "final" / "ema.safetensors"))
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


def test_ema_config_is_checked():
    with pytest.raises(ConfigError, match=r"trainer.ema.decay must be in \(0, 1\)"):
        TrainerArguments(ema={"decay": 1.5})
    with pytest.raises(ConfigError, match="trainer.ema.every_n_steps"):
        TrainerArguments(ema={"decay": 0.9, "every_n_steps": 0})


# -- FLOPs and MFU ---------------------------------------------------------------------------
class MLPData(DataInterface):
    def __init__(self, n=64):
        g = torch.Generator().manual_seed(0)
        self.ds = torch.utils.data.TensorDataset(torch.randn(n, 64, generator=g),
                                                 torch.randint(0, 10, (n,), generator=g))

    def get_train_dataset(self):
        return self.ds

    def get_val_dataset(self):
        return None


class MLP(ModuleInterface):
    def __init__(self, data, flops_per_sample=None):
        super().__init__()
        self.data = data
        if flops_per_sample is not None:
            self.flops_per_sample = flops_per_sample
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [torch.optim.SGD(self.parameters(), lr=0.1)], []

    def train_step(self, global_step, batch, device):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x.to(device)), y.to(device))


def test_flops_of_a_known_mlp(tmp_path):
    """Per sample: forward 2*(64*256 + 256*10) multiply-adds; backward 2x that for the
    second layer (input and weight gradients), 1x for the first (no input gradient)."""
    first, second = 64 * 256, 256 * 10
    hand = 2 * (first + second) + 2 * (first + 2 * second)
    module = MLP(MLPData())
    summary = Trainer(module, args(tmp_path, epochs=2, train_batch_size=16, micro_batch_size=8,
                                   peak_tflops=0.5)).train()
    assert summary["flops_per_sample"] == pytest.approx(hand, rel=0.03)
    train = [e for e in read_jsonl(tmp_path / "metrics.jsonl") if e["split"] == "train"]
    for event in train:
        assert event["tflops"] == pytest.approx(
            hand * event["samples_per_second"] / 1e12, rel=0.03)
        assert event["mfu"] == pytest.approx(event["tflops"] / 0.5)
    assert summary["mfu"] == pytest.approx(summary["tflops"] / 0.5)


def test_the_flops_counter_leaves_the_loop_after_the_first_step(tmp_path):
    """Counted once, the callback is removed: no per-step call for the rest of the run."""
    from sailfin.trainer.features.flops import FirstStepFlops

    calls = []

    class Watch(FirstStepFlops):
        def on_step_begin(self, trainer):
            calls.append(trainer.global_step)
            super().on_step_begin(trainer)

    trainer = Trainer(MLP(MLPData()), args(tmp_path, epochs=2, train_batch_size=16,
                                            micro_batch_size=8))
    trainer.setup()
    [counter] = [c for c in trainer.callbacks if type(c) is FirstStepFlops]
    watched = Watch(counter.meter)
    trainer.callbacks[trainer.callbacks.index(counter)] = watched
    summary = trainer.train()
    assert calls == [0]  # the first step only
    assert watched not in trainer.callbacks
    assert summary["flops_per_sample"] > 0


def test_counting_flops_leaves_training_unchanged(tmp_path):
    counted, plain = MLP(MLPData()), MLP(MLPData())
    Trainer(counted, args(tmp_path / "a", train_batch_size=16, micro_batch_size=8)).train()
    Trainer(plain, args(tmp_path / "b", train_batch_size=16, micro_batch_size=8,
                        count_flops=False)).train()
    for a, b in zip(counted.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    assert "tflops" not in read_jsonl(tmp_path / "b" / "metrics.jsonl")[0]


def test_recipe_gives_its_own_flops(tmp_path):
    summary = Trainer(MLP(MLPData(), flops_per_sample=1e6), args(tmp_path)).train()
    assert summary["flops_per_sample"] == 1e6
    assert "mfu" not in summary  # CPU: no known peak, none given


def test_peak_table_and_meter():
    assert device_peak_tflops(torch.device("cpu"), "bf16") is None
    meter = FlopsMeter(world_size=2, peak_tflops=100.0, flops_per_sample=1e9)
    assert meter.metrics(samples_per_second=20_000) == {"tflops": 10.0, "mfu": 0.1}


def test_ema_turned_on_at_resume_starts_from_the_resumed_weights(tmp_path):
    ckpt = {"at_epoch_end": True}
    Trainer(LinearRecipe(IdData(100, 12)), args(tmp_path, epochs=1, checkpoint=ckpt)).train()
    module = LinearRecipe(IdData(100, 12))
    record = RecordWeights()
    trainer = Trainer(module, args(tmp_path, epochs=2, checkpoint=ckpt, ema={"decay": 0.5}),
                      callbacks=[record])
    trainer.setup()
    resumed = {k: v.detach().clone() for k, v in module.named_parameters()}
    trainer.train()
    want = expected_ema(resumed, record.after_step, 0.5, 1)
    got = load_file(str(tmp_path / "final" / "ema.safetensors"))
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)


def test_progress_and_summary_line_show_flops():
    from sailfin.trainer.features.progress import Progress, summary_text

    progress = Progress("lines")
    progress.log_metrics({"loss": 1.0, "lr": 0.1, "samples_per_second": 10.0,
                          "tflops": 0.25, "mfu": 0.4}, 1, 0, "train")
    assert "250 GFLOP/s (MFU 40.0%)" in progress._values_text(10, 1.0)
    line = summary_text({"global_step": 3, "samples_seen": 30, "train_seconds": 1.0,
                         "samples_per_second": 30.0, "tflops": 312.0, "mfu": 0.5,
                         "stopped_early": {"step": 3, "reason": "early stopping: ..."}})
    assert "312 TFLOP/s per device, MFU 50.0%" in line and "stopped early at step 3" in line


def test_ema_keeps_sharded_parameters_sharded(tmp_path):
    """FSDP2 parameters are DTensors: the average, the swap and the state stay DTensors
    (one process, a 1-rank CPU mesh)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from sailfin.config import EmaArguments
    from sailfin.trainer.features.ema import WeightAverage

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        fully_shard(net, mesh=init_device_mesh("cpu", (1,)))
        ema = WeightAverage(net, EmaArguments(decay=0.5))
        start = [p.full_tensor().clone() for p in net.parameters()]
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        net(torch.randn(3, 4)).sum().backward()
        opt.step()
        ema.update()
        want = [0.5 * a + 0.5 * p.full_tensor() for a, p in zip(start, net.parameters())]
        assert all(isinstance(s, DTensor) for s in ema.shadow)
        for s, w in zip(ema.shadow, want):
            torch.testing.assert_close(s.full_tensor(), w)
        trained = [p.full_tensor().clone() for p in net.parameters()]
        with ema.swapped_in(net):
            for p, w in zip(net.parameters(), want):
                torch.testing.assert_close(p.full_tensor(), w)
        for p, t in zip(net.parameters(), trained):
            assert torch.equal(p.full_tensor(), t)
    finally:
        dist.destroy_process_group()
