"""Mixed precision: bf16 autocast on CPU, fp16 loss scaling, backend names."""

import pytest
import torch
from torch import nn

from sailfin import ConfigError, Trainer, TrainerArguments
from sailfin.backends import ALIASES, MixedPrecision, build_backend
from sailfin.distributed import DistEnv
from tests.recipes import IdData, LinearRecipe, args



class AutocastProbe(LinearRecipe):
    """Records, inside train_step, whether autocast is on and what a Linear returns."""

    def train_step(self, global_step, batch, device):
        self.events.append(("autocast", torch.is_autocast_enabled("cpu"),
                            torch.get_autocast_dtype("cpu"),
                            self.linear(batch[1].to(device)).dtype))
        return super().train_step(global_step, batch, device)


def test_names_resolve_to_compositions():
    assert ALIASES["sp"] == ("single", "fp32")
    assert ALIASES["sp-amp"] == ("single", "amp")
    assert ALIASES["sp-amp-apex"] == ("single", "amp")
    backend = build_backend(TrainerArguments(backend="sp-amp", device="cpu"), DistEnv())
    assert backend.name == "single+bf16"  # bf16 is the default where the device has it
    backend = build_backend(TrainerArguments(backend="sp-amp", amp_dtype="float16",
                                             device="cpu"), DistEnv())
    assert backend.name == "single+fp16" and backend.precision.scaler is not None


def test_apex_name_prints_one_line_notice(capsys):
    backend = build_backend(TrainerArguments(backend="sp-amp-apex", device="cpu"), DistEnv())
    assert backend.name == "single+bf16"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "native AMP" in err


def test_wrong_names_and_combinations_are_config_errors():
    with pytest.raises(ConfigError, match=r"'sp-ampp' \(did you mean 'sp-amp'\?\).*valid "
                                          r"backends: auto, sp, ") as info:
        build_backend(TrainerArguments(backend="sp-ampp"), DistEnv())
    assert all(name in str(info.value) for name in ALIASES)
    with pytest.raises(ConfigError, match="amp_dtype is float16 but trainer.backend sp runs "
                                          "in float32; use a mixed-precision backend"):
        build_backend(TrainerArguments(backend="sp", amp_dtype="float16"), DistEnv())
    with pytest.raises(ConfigError, match="did you mean 'bfloat16'"):
        TrainerArguments(amp_dtype="bfloat")


def test_bf16_autocast_is_active_inside_train_step_on_cpu(tmp_path):
    module = AutocastProbe(IdData(40, 0))
    Trainer(module, args(tmp_path, backend="sp-amp", device="cpu")).train()
    probes = [e for e in module.events if e[0] == "autocast"]
    assert len(probes) == 4
    assert all(p[1:] == (True, torch.bfloat16, torch.bfloat16) for p in probes)
    # ... and not outside it: the fp32 backend runs without autocast.
    plain = AutocastProbe(IdData(40, 0))
    Trainer(plain, args(tmp_path / "fp32", device="cpu")).train()
    assert all(e[1] is False and e[3] == torch.float32 for e in plain.events
               if e[0] == "autocast")


class SmallNet(LinearRecipe):
    """A 2-layer MLP (matmuls are what autocast lowers) on the same id data."""

    def __init__(self, data, loss_factor=1.0, **kw):
        super().__init__(data, **kw)
        torch.manual_seed(0)
        self.linear = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))
        self.loss_factor = loss_factor

    def train_step(self, global_step, batch, device):
        loss, stats = super().train_step(global_step, batch, device)
        return loss * self.loss_factor, stats


def test_bf16_loss_stays_close_to_fp32(tmp_path):
    losses = {}
    for backend in ("sp", "sp-amp"):
        module = SmallNet(IdData(80, 0), lr=0.02)
        recorded = []
        module.on_end_train_step = lambda step, loss, stats, r=recorded: r.append(loss.item())
        Trainer(module, args(tmp_path / backend, backend=backend, device="cpu",
                             epochs=2)).train()
        losses[backend] = recorded
    assert len(losses["sp"]) == 16
    torch.testing.assert_close(torch.tensor(losses["sp-amp"]), torch.tensor(losses["sp"]),
                               rtol=0.03, atol=0.02)
    assert losses["sp"][-1] < losses["sp"][0] / 2  # it trained


# -- float16 loss scaling (runs on CPU: torch has CPU fp16 autocast and GradScaler) --------
class InfGradAt(torch.autograd.Function):
    """Identity forward; backward returns inf gradients (the loss itself stays finite)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class OverflowAt(LinearRecipe):
    """Gradients are inf at ``bad_steps``. The loss is scaled down so that fp16 gradients
    times GradScaler's initial 65536 stay in range on the other steps."""

    def __init__(self, data, bad_steps, **kw):
        super().__init__(data, **kw)
        self.bad_steps = set(bad_steps)

    def train_step(self, global_step, batch, device):
        loss, stats = super().train_step(global_step, batch, device)
        loss = loss * 1e-3
        if global_step in self.bad_steps:
            loss = InfGradAt.apply(loss)
        return loss, stats


def fp16_args(tmp_path, **kw):
    return args(tmp_path, backend="sp-amp", amp_dtype="float16", device="cpu", **kw)


def test_fp16_skipped_step_keeps_weights_and_schedule(tmp_path):
    module = OverflowAt(IdData(60, 0), bad_steps={2})
    trainer = Trainer(module, fp16_args(tmp_path, max_steps=2), writers=[])  # train() again
    trainer.train()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    scale = trainer.backend.precision.scaler.get_scale()
    sched = trainer.schedulers[0]
    assert sched.last_epoch == 2
    trainer.args.max_steps = 3
    trainer.train()  # step 3 (global_step=2) has inf gradients
    for k, v in module.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert sched.last_epoch == 2  # the skipped step did not advance the schedule
    assert trainer.backend.precision.scaler.get_scale() == scale / 2
    assert trainer.global_step == 3  # its samples still count as consumed
    trainer.args.max_steps = 4
    trainer.train()
    assert sched.last_epoch == 3 and any(
        not torch.equal(v, before[k]) for k, v in module.state_dict().items())


def test_fp16_unscales_before_clipping():
    data = IdData(20, 0)
    grads = {}
    for backend, dtype in (("sp", "auto"), ("sp-amp", "float16")):
        module = SmallNet(data, loss_factor=1e-3)
        be = build_backend(TrainerArguments(backend=backend, amp_dtype=dtype, device="cpu"),
                           DistEnv())
        be.setup(module)
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        batch = next(iter(torch.utils.data.DataLoader(data.train, batch_size=20)))
        loss, _ = be.train_step(module, 0, batch)
        be.backward(loss)
        norm = be.clip_grad_norm(list(module.parameters()), [opt], max_norm=1e-3)
        grads[backend] = (norm, torch.cat([p.grad.flatten() for p in module.parameters()]))
        assert be.optimizer_step([opt])
    scale = 2.0 ** 16
    norm32, norm16 = grads["sp"][0], grads["sp-amp"][0]
    # The norm clipped is the true one, not the scaled one (65536 times larger).
    torch.testing.assert_close(norm16, norm32, rtol=2e-2, atol=0)
    assert norm16 < norm32 * scale / 100
    torch.testing.assert_close(grads["sp-amp"][1], grads["sp"][1], rtol=5e-2, atol=1e-6)
    assert grads["sp-amp"][1].norm() <= 1e-3 * 1.01  # and clipped


def test_fp16_scaler_state_round_trips_through_backend_state(tmp_path):
    module = OverflowAt(IdData(60, 0), bad_steps={0, 1})
    trainer = Trainer(module, fp16_args(tmp_path, max_steps=3))
    trainer.train()
    state = trainer.backend.state_dict()
    assert state["precision"]["scaler"]["scale"] == 2.0 ** 14  # halved twice
    fresh = build_backend(TrainerArguments(backend="sp-amp", amp_dtype="float16",
                                           device="cpu"), DistEnv())
    assert fresh.precision.scaler.get_scale() == 2.0 ** 16
    fresh.load_state_dict(state)
    assert fresh.precision.scaler.get_scale() == 2.0 ** 14
    bf16 = build_backend(TrainerArguments(backend="sp-amp", device="cpu"), DistEnv())
    assert bf16.state_dict() == {"precision": {}}  # bf16 has no scale to carry


def test_amp_default_dtype_rules():
    from sailfin.backends.precision import default_amp_dtype

    assert default_amp_dtype(torch.device("cpu")) == "bfloat16"
    assert default_amp_dtype(torch.device("mps")) == "float16"


@pytest.mark.cuda  # checks the CUDA default dtype (bf16 from Ampere on, else fp16), an fp16 step
def test_cuda_amp(tmp_path):
    expected = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    from sailfin.backends.precision import default_amp_dtype

    assert default_amp_dtype(torch.device("cuda")) == expected
    module = OverflowAt(IdData(60, 0), bad_steps={1})
    trainer = Trainer(module, args(tmp_path, backend="sp-amp", amp_dtype="float16",
                                   device="cuda", max_steps=3))
    trainer.train()
    assert trainer.schedulers[0].last_epoch == 2  # one of three steps skipped
    assert isinstance(trainer.backend.precision, MixedPrecision)
