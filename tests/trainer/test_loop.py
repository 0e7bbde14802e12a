import json

import pytest
import torch
from safetensors.torch import load_file

from sailfin import Callback, Trainer
from sailfin.data.sampler import epoch_order
from tests.recipes import IdData, LinearRecipe, args


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def params(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("micro", [48, 16, 8])
def test_accumulation_equals_one_big_batch(tmp_path, micro):
    """90 samples, global 48: steps of 48 and 42; micro 16 makes a short (10) micro-batch."""
    ref = LinearRecipe(IdData(90, 0), momentum=0.9)
    Trainer(ref, args(tmp_path / "ref", epochs=3, train_batch_size=48,
                      micro_batch_size=48)).train()
    acc = LinearRecipe(IdData(90, 0), momentum=0.9)
    Trainer(acc, args(tmp_path / "acc", epochs=3, train_batch_size=48,
                      micro_batch_size=micro)).train()
    assert acc.step_ids == ref.step_ids  # step k trains on the same samples
    for k, v in params(ref).items():
        torch.testing.assert_close(params(acc)[k], v, rtol=1e-5, atol=1e-6)
    if micro == 16:
        assert [len(b) for b in acc.seen[:6]] == [16, 16, 16, 16, 16, 10]


def test_steps_follow_the_epoch_order(tmp_path):
    module = LinearRecipe(IdData(25, 0))
    Trainer(module, args(tmp_path, epochs=2, train_batch_size=10, micro_batch_size=5,
                         seed=7)).train()
    for epoch in range(2):
        order = epoch_order(25, 7, epoch).tolist()
        steps = module.step_ids[epoch * 3:(epoch + 1) * 3]
        assert steps == [order[0:10], order[10:20], order[20:25]]  # last step short, own step


def test_drop_last(tmp_path):
    module = LinearRecipe(IdData(25, 0))
    summary = Trainer(module, args(tmp_path, train_batch_size=10, drop_last=True)).train()
    assert summary["global_step"] == 2 and summary["samples_seen"] == 20


def test_callbacks_in_order(tmp_path):
    module = LinearRecipe(IdData(20, 5))
    Trainer(module, args(tmp_path, epochs=2, train_batch_size=10, micro_batch_size=5)).train()
    names = [e[0] for e in module.events]
    assert names == ["begin_epoch", "end_backward", "end_step", "end_backward", "end_step",
                     "end_epoch", "val"] * 2 + ["end_train"]
    assert [e[1] for e in module.events if e[0] == "end_step"] == [1, 2, 3, 4]


def test_outputs_metrics_summary_and_weights(tmp_path):
    module = LinearRecipe(IdData(40, 12))
    summary = Trainer(module, args(tmp_path, epochs=2, log_every_n_steps=2)).train()
    events = read_jsonl(tmp_path / "metrics.jsonl")
    train = [e for e in events if e["split"] == "train"]
    val = [e for e in events if e["split"] == "val"]
    assert [e["step"] for e in train] == [2, 4, 6, 8]
    assert [e["epoch"] for e in train] == [1, 1, 2, 2]  # counted from 1, as on the console
    assert all({"loss", "lr", "batch_size", "samples_per_second"} <= set(e) for e in train)
    assert [(e["step"], e["epoch"], e["count"]) for e in val] == [(4, 1, 12), (8, 2, 12)]
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved == json.loads(json.dumps(summary))
    assert {"global_step", "epoch", "samples_seen", "train_seconds", "samples_per_second",
            "world_size", "val"} <= set(saved)
    assert saved["global_step"] == 8 and saved["samples_seen"] == 80
    assert saved["val"]["mse"] == pytest.approx(val[-1]["mse"])
    weights = load_file(str(tmp_path / "final" / "model.safetensors"))
    for k, v in params(module).items():
        torch.testing.assert_close(weights[k], v)


def test_validation_outputs_are_in_dataset_order_and_complete(tmp_path):
    module = LinearRecipe(IdData(20, 23))
    Trainer(module, args(tmp_path, val_batch_size=4)).train()
    (_, _, key, ids), = [e for e in module.events if e[0] == "val"]
    assert key == "val" and ids == list(range(23))


def test_loss_is_the_step_mean(tmp_path):
    """The logged loss equals the mean loss over the step's samples, accumulated or not."""
    logged = {}
    for micro in (10, 5):
        module = LinearRecipe(IdData(20, 0), lr=0.0)
        Trainer(module, args(tmp_path / str(micro), micro_batch_size=micro)).train()
        events = read_jsonl(tmp_path / str(micro) / "metrics.jsonl")
        logged[micro] = [e["loss"] for e in events]
    assert logged[10] == pytest.approx(logged[5], rel=1e-6)


def test_several_validation_sets(tmp_path):
    class TwoVal(IdData):
        def get_val_datasets(self):
            return {"near": self.val, "far": self.train}

    module = LinearRecipe(TwoVal(10, 6))
    summary = Trainer(module, args(tmp_path)).train()
    assert set(summary["val"]) == {"near", "far"}
    assert summary["val"]["near"]["count"] == 6 and summary["val"]["far"]["count"] == 10
    val = [e for e in read_jsonl(tmp_path / "metrics.jsonl") if e["split"] == "val"]
    assert [e["dataset"] for e in val] == ["near", "far"]


def test_max_steps_stops_and_validates_the_final_model(tmp_path):
    module = LinearRecipe(IdData(100, 5))
    summary = Trainer(module, args(tmp_path, epochs=5, max_steps=13)).train()
    # 10 steps an epoch: step 13 is inside the second epoch, counted from 1.
    assert summary["global_step"] == 13 and summary["epoch"] == 2
    val_steps = [e[1] for e in module.events if e[0] == "val"]
    assert val_steps == [10, 13]


def test_max_train_steps_per_epoch(tmp_path):
    module = LinearRecipe(IdData(100, 0))
    summary = Trainer(module, args(tmp_path, epochs=2, max_train_steps_per_epoch=3)).train()
    assert summary["global_step"] == 6


def test_scheduler_steps_once_per_optimizer_step(tmp_path):
    module = LinearRecipe(IdData(100, 0), lr=0.1)
    trainer = Trainer(module, args(tmp_path, micro_batch_size=5))  # 2 micro-batches a step
    trainer.train()
    # StepLR(step_size=5, gamma=0.9) after 10 optimizer steps
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.9 ** 2)


def test_gradient_clipping(tmp_path):
    class Watch(LinearRecipe):
        def get_optimizers_schedulers(self, *a):
            return [torch.optim.SGD(self.parameters(), lr=1.0)], []

    module = Watch(IdData(10, 0))
    before = torch.cat([p.detach().flatten().clone() for p in module.parameters()])
    Trainer(module, args(tmp_path, max_grad_norm=0.01)).train()
    after = torch.cat([p.detach().flatten() for p in module.parameters()])
    assert (after - before).norm() == pytest.approx(0.01, rel=1e-4)


def test_same_seed_same_result(tmp_path):
    runs = []
    for i in range(2):
        module = LinearRecipe(IdData(50, 0), dropout=0.3)
        Trainer(module, args(tmp_path / str(i), epochs=2)).train()
        runs.append(params(module))
    for k in runs[0]:
        assert torch.equal(runs[0][k], runs[1][k])


def test_trainer_callbacks(tmp_path):
    seen = []

    class Watch(Callback):
        def on_train_start(self, trainer):
            seen.append("start")

        def on_step_end(self, trainer):
            seen.append(trainer.global_step)

        def on_validation_end(self, trainer, metrics):
            seen.append(("val", metrics["val"]["count"]))

        def on_epoch_end(self, trainer):
            seen.append("epoch")

        def on_train_end(self, trainer):
            seen.append("end")

    Trainer(LinearRecipe(IdData(20, 3)), args(tmp_path), callbacks=[Watch()]).train()
    assert seen == ["start", 1, 2, ("val", 3), "epoch", "end"]


def test_loader_that_ignores_the_sampler_is_refused(tmp_path):
    class NoSampler(LinearRecipe):
        def get_train_dataloader(self, sampler, batch_size):
            return torch.utils.data.DataLoader(self.data.train, batch_size=batch_size)

    with pytest.raises(ValueError, match=r"did not call sampler\(dataset\)"):
        Trainer(NoSampler(IdData(10, 0)), args(tmp_path)).train()


def test_loader_with_another_batch_size_is_refused(tmp_path):
    class WrongBatch(LinearRecipe):
        def get_train_dataloader(self, sampler, batch_size):
            ds = self.data.train
            return torch.utils.data.DataLoader(ds, batch_size=3, sampler=sampler(ds))

    with pytest.raises(ValueError, match="must use batch_size=10"):
        Trainer(WrongBatch(IdData(10, 0)), args(tmp_path)).train()


def test_no_validation_data(tmp_path):
    summary = Trainer(LinearRecipe(IdData(10, 0)), args(tmp_path)).train()
    assert summary["val"] == {}


def test_unknown_backend_lists_valid_ones(tmp_path):
    from sailfin.config import ConfigError

    with pytest.raises(ConfigError, match="'spp'.*did you mean 'sp'.*valid backends: auto, sp, "):
        Trainer(LinearRecipe(IdData(10, 0)), args(tmp_path, backend="spp"))


def test_bad_output_dir_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    module = LinearRecipe(IdData(10, 0))
    with pytest.raises(OSError):
        Trainer(module, args(blocker / "out")).train()
    assert module.seen == []
