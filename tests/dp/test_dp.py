"""DP-SGD (sp-dp): accounting against Opacus's own accountant, clipping, bad input."""

import json
import math

import pytest
import torch
from torch import nn

from sailfin import Trainer
from sailfin.config.errors import ConfigError
from tests.dp.recipes import NormRecipe, PerSampleRecipe, dp_args
from tests.recipes import IdData, LinearRecipe

pytest.importorskip("opacus")
from opacus.accountants import RDPAccountant  # noqa: E402


def events(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_epsilon_equals_opacus_rdp_accountant_for_the_same_history(tmp_path):
    module = LinearRecipe(IdData(47, 9))
    summary = Trainer(module, dp_args(tmp_path)).train()
    steps = summary["global_step"]
    assert steps == 10  # ceil(47 / 10) steps per epoch, 2 epochs
    reference = RDPAccountant()
    reference.history = [(1.1, 10 / 47, steps)]
    expected = reference.get_epsilon(delta=1 / 47)
    privacy = summary["privacy"]
    assert privacy["accounted_steps"] == steps and privacy["sample_rate"] == 10 / 47
    assert abs(privacy["epsilon"] - expected) < 1e-9
    logged = [e["epsilon"] for e in events(tmp_path) if "epsilon" in e]
    assert len(logged) == steps and abs(logged[-1] - expected) < 1e-9
    for k, eps in enumerate(logged, 1):  # every step's figure is the accountant's
        reference.history = [(1.1, 10 / 47, k)]
        assert abs(eps - reference.get_epsilon(delta=1 / 47)) < 1e-9
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["privacy"]["epsilon"] == privacy["epsilon"]


def test_poisson_steps_vary_and_draw_each_sample_at_the_sampling_rate(tmp_path):
    module = LinearRecipe(IdData(200, 0))
    Trainer(module, dp_args(tmp_path, epochs=3, train_batch_size=20, micro_batch_size=5,
                            dp={"noise_multiplier": 1.0})).train()
    steps = module.step_ids if module.step_ids else None
    sizes = {len(ids) for ids in module.seen}
    assert max(sizes) <= 5 and len(sizes) > 2  # micro-batches cut from varying batches
    total = sum(len(ids) for ids in module.seen)
    # 30 steps, each sample with probability 0.1: 600 expected, sd ~ 23.
    assert 500 < total < 700, (total, steps)


def test_clipping_bounds_each_sample_gradient(tmp_path):
    data = IdData(8, 0)
    data.train.y[3] = 1e6  # one sample whose gradient is enormous
    module = LinearRecipe(data, lr=1.0)
    before = [p.detach().clone() for p in module.parameters()]
    args = dp_args(tmp_path, epochs=1, train_batch_size=8, micro_batch_size=4,
                   dp={"noise_multiplier": 1e-9, "max_grad_norm": 0.5,
                       "poisson_sampling": False})
    Trainer(module, args).train()
    # By hand: each sample's gradient clipped to norm 0.5, summed, over the batch of 8.
    ref = LinearRecipe(data)
    ref.load_state_dict({"linear.weight": before[0], "linear.bias": before[1]})
    total = [torch.zeros_like(p) for p in before]
    for i in range(8):
        _, x, y = data.train[i]
        ref.zero_grad()
        nn.functional.mse_loss(ref(x[None]), y[None]).backward()
        grads = [p.grad for p in ref.parameters()]
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        for t, g in zip(total, grads):
            t += g * min(1.0, 0.5 / (norm.item() + 1e-6))
    for p, b, t in zip(module.parameters(), before, total):
        assert torch.allclose(p.detach(), b - t / 8, atol=1e-5)
    step = torch.sqrt(sum((p.detach() - b).pow(2).sum() for p, b in zip(module.parameters(),
                                                                        before)))
    assert step <= 8 * 0.5 / 8 + 1e-4  # the 1e6 sample moved the weights by at most C/B


def test_ghost_clipping_matches_flat_clipping(tmp_path):
    runs = {}
    for clipping in ("flat", "ghost"):
        module = PerSampleRecipe(IdData(47, 0))
        summary = Trainer(module, dp_args(tmp_path / clipping, dp={
            "noise_multiplier": 0.7, "max_grad_norm": 0.3, "clipping": clipping})).train()
        runs[clipping] = (torch.cat([p.detach().reshape(-1) for p in module.parameters()]),
                          summary["privacy"]["epsilon"], module.seen)
    assert runs["flat"][2] == runs["ghost"][2]  # the same Poisson batches
    assert torch.allclose(runs["flat"][0], runs["ghost"][0], atol=1e-5)
    assert runs["flat"][1] == runs["ghost"][1]


def test_per_layer_clipping_trains(tmp_path):
    module = LinearRecipe(IdData(47, 0))
    before = module.linear.weight.detach().clone()
    summary = Trainer(module, dp_args(tmp_path, dp={"noise_multiplier": 1.0,
                                                    "clipping": "per_layer"})).train()
    assert not torch.equal(before, module.linear.weight) and summary["privacy"]["epsilon"] > 0


def test_target_epsilon_sets_the_noise_that_spends_it(tmp_path):
    summary = Trainer(LinearRecipe(IdData(47, 0)), dp_args(
        tmp_path, dp={"target_epsilon": 5.0, "noise_multiplier": None})).train()
    eps = summary["privacy"]["epsilon"]
    assert 4.9 < eps <= 5.0, eps


def test_max_epsilon_stops_before_the_step_that_would_pass_it(tmp_path):
    reference = RDPAccountant()
    reference.history = [(1.1, 10 / 47, 4)]
    limit = reference.get_epsilon(delta=1 / 47) + 1e-9  # 4 steps fit, the 5th does not
    summary = Trainer(LinearRecipe(IdData(47, 0)), dp_args(
        tmp_path, dp={"noise_multiplier": 1.1, "max_epsilon": limit})).train()
    assert summary["global_step"] == 4
    assert summary["stopped_early"]["reason"] == "max_epsilon"
    assert summary["privacy"]["epsilon"] <= limit


def test_batchnorm_is_refused_with_the_way_out(tmp_path):
    module = NormRecipe(IdData(47, 0))
    with pytest.raises(ConfigError) as info:
        Trainer(module, dp_args(tmp_path)).train()
    text = str(info.value)
    assert "norm (BatchNorm1d)" in text and "GroupNorm" in text
    assert "trainer.dp.fix_model: true" in text
    assert module.seen == []


def test_fix_model_replaces_batchnorm_and_trains(tmp_path):
    module = NormRecipe(IdData(47, 0))
    Trainer(module, dp_args(tmp_path, dp={"noise_multiplier": 1.0, "fix_model": True})).train()
    assert isinstance(module.norm, nn.GroupNorm) and module.seen


@pytest.mark.parametrize("dp, key", [
    ({"max_grad_norm": 0}, "trainer.dp.max_grad_norm"),
    ({"max_grad_norm": -1.0}, "trainer.dp.max_grad_norm"),
    ({"delta": 0.05}, "trainer.dp.delta"),  # >= 1/47
    ({"target_epsilon": 1e-3, "noise_multiplier": None, "delta": 1e-5},
     "trainer.dp.target_epsilon"),
    ({"noise_multiplier": None}, "trainer.dp.target_epsilon"),
    ({"max_epsilon": 1e-6}, "trainer.dp.max_epsilon"),
    ({"clipping": "flatt"}, "trainer.dp.clipping"),
])
def test_bad_input_is_refused_before_the_first_step(tmp_path, dp, key):
    module = LinearRecipe(IdData(47, 0))
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        Trainer(module, dp_args(tmp_path, dp={"noise_multiplier": 1.0, **dp})).train()
    assert module.seen == []


def test_large_delta_is_accepted_when_allowed(tmp_path):
    summary = Trainer(LinearRecipe(IdData(47, 0)), dp_args(
        tmp_path, dp={"delta": 0.05, "allow_large_delta": True})).train()
    assert summary["privacy"]["delta"] == 0.05


@pytest.mark.parametrize("kw, key", [
    ({"max_grad_norm": 1.0}, "trainer.max_grad_norm"),
    ({"backend": "sp-amp-dp"}, "mixed precision"),
    ({"backend": "sp", "dp": {"noise_multiplier": 1.0}}, "trainer.dp is set"),
])
def test_settings_dp_cannot_honour_are_refused(tmp_path, kw, key):
    with pytest.raises(ConfigError, match=key):
        Trainer(LinearRecipe(IdData(47, 0)), dp_args(tmp_path, **kw)).train()


def test_two_optimizers_are_refused(tmp_path):
    class Two(LinearRecipe):
        def get_optimizers_schedulers(self, steps, epochs):
            return [torch.optim.SGD([self.linear.weight], lr=0.1),
                    torch.optim.SGD([self.linear.bias], lr=0.1)], []
    with pytest.raises(ConfigError, match="one optimizer"):
        Trainer(Two(IdData(47, 0)), dp_args(tmp_path)).train()


def test_resume_continues_the_same_noise_batches_and_epsilon(tmp_path):
    """In-process: stop after 4 steps (checkpoint), resume, compare to a straight run."""
    ref = LinearRecipe(IdData(47, 0))
    ref_summary = Trainer(ref, dp_args(tmp_path / "ref", epochs=3)).train()
    first = LinearRecipe(IdData(47, 0))
    ck = {"every_n_steps": 4}
    Trainer(first, dp_args(tmp_path / "run", epochs=3, max_steps=6, checkpoint=ck)).train()
    second = LinearRecipe(IdData(47, 0))
    summary = Trainer(second, dp_args(tmp_path / "run", epochs=3, checkpoint=ck)).train()
    for a, b in zip(ref.parameters(), second.parameters()):
        assert torch.equal(a, b)
    assert summary["privacy"]["epsilon"] == ref_summary["privacy"]["epsilon"]
    assert summary["samples_seen"] == ref_summary["samples_seen"]
    assert not math.isnan(summary["privacy"]["epsilon"])


def test_a_target_that_promises_no_privacy_is_refused_and_the_advice_works(tmp_path, capsys):
    """target_epsilon 1e9 would train at noise ~1e-59 and report epsilon 1e9: one line,
    exit 2, before step 1; the key it names lets the run train."""
    from sailfin.cli import main

    path = tmp_path / "run.yaml"
    path.write_text(
        "data: {class_path: tests.recipes.IdData, init_args: {n_train: 47, n_val: 0}}\n"
        "module: {class_path: tests.recipes.LinearRecipe}\n"
        f"trainer: {{backend: sp-dp, epochs: 1, train_batch_size: 10, writers: [jsonl],\n"
        f"          output_dir: {tmp_path / 'out'}, dp: {{target_epsilon: 1e9}}}}\n")
    assert main(["train", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert ("trainer.dp.target_epsilon 1e+09 promises no meaningful privacy (above 100"
            in lines[0] and "set trainer.dp.allow_weak_privacy: true" in lines[0])
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    assert main(["train", str(path), "--trainer.dp.allow_weak_privacy", "true"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["global_step"] > 0 and summary["privacy"]["epsilon"] <= 1e9


def test_fix_model_with_an_in_place_residual_is_refused_naming_the_module(tmp_path, capsys):
    """torchvision's resnet18 under sp-dp with fix_model: its BatchNorms become GroupNorm,
    then ``out += identity`` on a hooked output crashed deep in step 1. Now: one line
    naming the block, before any step is taken."""
    from sailfin.cli import main
    from tests.dp.recipes import ResidualRecipe

    module = ResidualRecipe(IdData(47, 0))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(ConfigError) as info:
        Trainer(module, dp_args(tmp_path / "a", dp={"fix_model": True})).train()
    text = str(info.value)
    assert text.startswith("trainer.backend sp-dp: block (Residual) changes a layer's output "
                           "in place (such as out += identity")
    assert "\n" not in text and "out = out + identity" in text
    assert isinstance(module.block.bn1, nn.GroupNorm)  # fix_model did its part
    assert not (tmp_path / "a" / "checkpoints").exists() or not any(
        (tmp_path / "a" / "checkpoints").glob("step-*"))
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items()
               if k in before and "bn" not in k)
    path = tmp_path / "run.yaml"
    path.write_text(
        "data: {class_path: tests.recipes.IdData, init_args: {n_train: 47, n_val: 0}}\n"
        "module: {class_path: tests.dp.recipes.ResidualRecipe}\n"
        f"trainer: {{backend: sp-dp, train_batch_size: 10, writers: [jsonl],\n"
        f"          output_dir: {tmp_path / 'b'}, dp: {{noise_multiplier: 1.0, fix_model: true}}}}\n")
    assert main(["train", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    # The notices of what fix_model replaced, then the refusal: one line, the last.
    refusals = [ln for ln in lines if "changes a layer's output in place" in ln]
    assert refusals == [lines[-1]] and "block (Residual)" in lines[-1]
    assert not any("Traceback" in ln for ln in lines)
