"""Compiled execution: same losses as eager, compiled once, composes, fails clearly."""

import pytest
import torch
from torch._dynamo.utils import counters

from sailfin import Trainer
from sailfin.backends import SingleDevice
from sailfin.backends import strategy as strategy_module
from sailfin.backends.strategy import CompileError, Execution
from tests.backends.lm import TinyLM
from tests.recipes import args


def lm_args(tmp_path, **kw):
    return args(tmp_path, train_batch_size=8, micro_batch_size=8, device="cpu", **kw)


def params(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_compiled_matches_eager_and_compiles_once(tmp_path):
    """torch.compile (inductor) gives the eager losses; 3 epochs compile one graph."""
    eager = TinyLM()
    Trainer(eager, lm_args(tmp_path / "eager", epochs=3)).train()
    torch._dynamo.reset()
    counters.clear()
    compiled = TinyLM()
    trainer = Trainer(compiled, lm_args(tmp_path / "compiled", compile=True, epochs=3),
                      writers=[])
    trainer.train()
    assert counters["stats"]["unique_graphs"] == 1  # once, not per epoch or per step
    assert len(compiled.losses) == len(eager.losses) == 12
    torch.testing.assert_close(torch.tensor(compiled.losses), torch.tensor(eager.losses),
                               rtol=1e-4, atol=1e-5)
    for name, value in params(eager).items():
        torch.testing.assert_close(params(compiled)[name], value, rtol=1e-3, atol=1e-5)
    assert list(params(compiled)) == list(params(eager))  # no '_orig_mod.' prefixes


def _fast_compile(monkeypatch, backend="aot_eager"):
    """Compile with a backend that skips code generation (seconds instead of tens)."""
    def compile_in_place(runner, mode):
        runner.compile(backend=backend)
    monkeypatch.setattr(strategy_module, "compile_in_place", compile_in_place)


class Wrapper(torch.nn.Module):
    """Stands for a strategy's wrapper (DDP): sees the step through forward."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, *args):
        self.calls += 1
        return self.inner(*args)


class Wrapping(SingleDevice):
    def wrap(self, runner):
        return Wrapper(runner)


def test_compile_composes_with_wrap_and_amp(tmp_path, monkeypatch):
    _fast_compile(monkeypatch)
    torch._dynamo.reset()
    counters.clear()
    backend = Wrapping(_bf16(), torch.device("cpu"),
                       execution=Execution(compile=True, activation_checkpointing=("Block",)))
    module = TinyLM(layers=2)
    Trainer(module, lm_args(tmp_path, epochs=2), backend=backend, writers=[]).train()
    assert isinstance(backend.runner, Wrapper) and backend.runner.calls == 8
    assert backend.runner.inner._compiled_call_impl is not None  # compiled inside the wrapper
    assert backend.checkpointed == ["blocks.0", "blocks.1"]
    assert counters["stats"]["unique_graphs"] >= 1
    reference = TinyLM(layers=2)
    Trainer(reference, lm_args(tmp_path / "ref", epochs=2, backend="sp-amp"),
            writers=[]).train()
    torch.testing.assert_close(torch.tensor(module.losses), torch.tensor(reference.losses),
                               rtol=2e-2, atol=2e-2)


def _bf16():
    from sailfin.backends import MixedPrecision

    return MixedPrecision("bfloat16", torch.device("cpu"))


def test_uncompilable_model_names_the_reason_and_the_key(tmp_path, monkeypatch):
    def broken_backend(gm, example_inputs):
        raise RuntimeError("this backend cannot lower aten.addmm")

    _fast_compile(monkeypatch, backend=broken_backend)
    torch._dynamo.reset()
    trainer = Trainer(TinyLM(), lm_args(tmp_path, compile=True), writers=[])
    with pytest.raises(CompileError) as info:
        trainer.train()
    message = str(info.value)
    assert "torch.compile could not compile TinyLM.train_step" in message
    assert "this backend cannot lower aten.addmm" in message
    assert "trainer.compile: false" in message


def test_eager_fp32_path_calls_the_recipe_directly():
    from sailfin.backends import PlainSingleDevice, build_backend
    from sailfin.config.trainer import TrainerArguments
    from sailfin.distributed import DistEnv

    backend = build_backend(TrainerArguments(backend="sp", device="cpu"), DistEnv())
    assert type(backend) is PlainSingleDevice  # sp, fp32, not compiled
    module = TinyLM()
    backend.setup(module)
    assert backend.runner is None
    # No runner, no autocast per step: the step methods are PyTorch's own calls.
    assert backend.backward is torch.Tensor.backward and not vars(backend).keys() & {
        "train_step", "backward", "optimizer_step"}
    compiled = build_backend(TrainerArguments(backend="sp", device="cpu", compile=True),
                             DistEnv())
    assert type(compiled) is SingleDevice


@pytest.mark.slow
def test_bf16_compiled_matches_bf16_eager(tmp_path):
    """The inductor-compiled bf16 step (real code generation) against eager bf16."""
    eager = TinyLM(layers=2)
    Trainer(eager, lm_args(tmp_path / "eager", epochs=2, backend="sp-amp"), writers=[]).train()
    torch._dynamo.reset()
    compiled = TinyLM(layers=2)
    Trainer(compiled, lm_args(tmp_path / "compiled", epochs=2, backend="sp-amp", compile=True),
            writers=[]).train()
    torch.testing.assert_close(torch.tensor(compiled.losses), torch.tensor(eager.losses),
                               rtol=1e-2, atol=1e-2)
