"""fsdp in one process, #22: the deferred (meta) build starts from the weights of an eager
build, init_from loads every kind of source into every backend, both accumulation
modes train as sp, the EMA is saved as shards and resumes, compile per unit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from sailfin import Trainer, deferred_build
from sailfin.backends.deferred import DeferredInitError, init_plan
from sailfin.checkpoint import CheckpointError
from tests.backends.test_fsdp import RUN, TwoLayer, assert_close, weights
from tests.recipes import IdData, WideRecipe, args


class Rich(WideRecipe):
    """Layers whose initialisation uses every path: reset_parameters of torch layers, a
    recipe-level manual_seed, a module's own init_weights with an argument, a parameter
    made by a deterministic factory and a buffer."""

    def __init__(self, data, **kw) -> None:
        super().__init__(data, **kw)
        self.norm = nn.LayerNorm(32)
        self.attn = nn.MultiheadAttention(32, 4)
        self.emb = nn.Embedding(10, 32)
        self.scaled = Scaled(32, std=0.5)
        self.gain = nn.Parameter(torch.ones(1))
        self.register_buffer("pos", torch.arange(5).float())


class Scaled(nn.Module):
    def __init__(self, dim, std):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dim))
        self.init_weights(std)

    def init_weights(self, std):
        nn.init.trunc_normal_(self.weight, std=std)


def eager_and_deferred(cls):
    torch.manual_seed(0)
    eager = cls(IdData(20, 0))
    torch.manual_seed(0)
    return eager, deferred_build(cls, IdData(20, 0))


@pytest.mark.parametrize("backend", ["sp", "fsdp"])
def test_deferred_build_starts_from_the_eager_weights(tmp_path, backend):
    eager, deferred = eager_and_deferred(Rich)
    assert deferred.linear.weight.is_meta and deferred.scaled.weight.is_meta
    assert not deferred.gain.is_meta  # small deterministic tensors are built for real
    with Trainer(deferred, args(tmp_path, backend=backend)) as trainer:
        trainer.setup()
        got = trainer.backend.final_state_dict(deferred)
    assert init_plan(deferred) is None
    ref = eager.state_dict()
    assert got.keys() == ref.keys()
    for key, value in ref.items():
        assert torch.equal(got[key], value), key


def test_a_deferred_run_trains_as_an_eager_one(tmp_path):
    ref = weights(run_built(tmp_path, "sp", "sp", TwoLayer(IdData(47, 9), momentum=0.9)))
    torch.manual_seed(123)  # the recipe seeds itself: the build does not depend on this
    module = deferred_build(TwoLayer, IdData(47, 9), momentum=0.9)
    assert_close(weights(run_built(tmp_path, "fsdp", "fsdp", module)), ref)


def run_built(tmp_path, name, backend, module, **kw):
    with Trainer(module, args(tmp_path / name, backend=backend, **{**RUN, **kw})) as t:
        t.train()
    return tmp_path / name


class InitInInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        nn.init.zeros_(self.lin.weight)  # outside any init method


class RandomParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))


class Uninitialised(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(3))


def test_initialisation_that_cannot_be_deferred_is_named():
    with pytest.raises(DeferredInitError, match=r"test_fsdp_build.py:\d+ \(__init__\) fills a "
                                                r"parameter in place \(zero_\) outside"):
        deferred_build(InitInInit)
    with pytest.raises(DeferredInitError, match=r"draws random values with torch.randn"):
        deferred_build(RandomParam)
    with pytest.raises(DeferredInitError, match=r"parameter 'w' of Uninitialised is "
                                                r"initialised by no reset_parameters"):
        deferred_build(Uninitialised)


# -- init_from: every source kind into every backend -------------------------------------
@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A trained sp run (checkpoint dir, its checkpoints/ and final safetensors) and an
    fsdp run (sharded checkpoint); the weights each one holds."""
    root = tmp_path_factory.mktemp("sources")
    out = {}
    for backend in ("sp", "fsdp"):
        run_built(root, backend, backend, TwoLayer(IdData(47, 9), momentum=0.9), epochs=1)
        step = root / backend / "checkpoints" / "step-00000003"
        out[backend] = step
    return {"sp checkpoint": out["sp"], "fsdp checkpoint": out["fsdp"],
            "checkpoints dir": root / "sp" / "checkpoints",
            "safetensors": root / "sp" / "final" / "model.safetensors"}


def saved_weights(source):
    """The weights the source holds, read back through sp (no init_from involved)."""
    if str(source).endswith(".safetensors"):
        return load_file(str(source))
    manifest = json.loads((source / "manifest.json").read_text()) if (
        source / "manifest.json").exists() else None
    if manifest is None or not manifest.get("sharded"):
        path = source / "model.pt" if manifest else sorted(source.glob("step-*"))[-1] / "model.pt"
        return torch.load(path, weights_only=True)
    import torch.distributed.checkpoint as dcp

    state = {"module": {k: torch.empty_like(v) for k, v in
                        TwoLayer(IdData(4, 0)).state_dict().items()}}
    dcp.load(state, checkpoint_id=str(source / "shards"), no_dist=True)
    return state["module"]


@pytest.mark.parametrize("kind", ["sp checkpoint", "fsdp checkpoint", "checkpoints dir",
                                  "safetensors"])
@pytest.mark.parametrize("backend", ["sp", "fsdp"])
def test_init_from_every_source_into_every_backend(tmp_path, sources, kind, backend):
    source = sources[kind]
    want = saved_weights(source)
    module = TwoLayer(IdData(47, 9))
    with Trainer(module, args(tmp_path, backend=backend, init_from=str(source))) as trainer:
        trainer.setup()
        got = trainer.backend.final_state_dict(module)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_init_from_errors_name_the_file_and_key(tmp_path, sources):
    from tests.recipes import LinearRecipe

    source = sources["fsdp checkpoint"]
    with pytest.raises(CheckpointError, match=r"init_from: the shards in .*step-00000003 do "
                                              r"not fit this model: .*linear.weight"):
        with Trainer(LinearRecipe(IdData(20, 0)), args(tmp_path / "a", backend="fsdp",
                                                       init_from=str(source))) as trainer:
            trainer.setup()
    bad = tmp_path / "bad.safetensors"
    state = {k: v for k, v in load_file(str(sources["safetensors"])).items()}
    state["linear.weight"] = torch.zeros(2, 8)
    save_file(state, str(bad))
    with pytest.raises(CheckpointError, match=r"tensor 'linear.weight' in .*bad.safetensors "
                                              r"has shape \[2, 8\], this model's has \[1, 8\]"):
        with Trainer(TwoLayer(IdData(20, 0)), args(tmp_path / "b", backend="fsdp",
                                                   init_from=str(bad))) as trainer:
            trainer.setup()


# -- accumulation, EMA, compile ----------------------------------------------------------
@pytest.mark.parametrize("accumulate", ["full", "sharded"])
def test_both_accumulation_modes_train_as_sp(tmp_path, accumulate):
    ref = weights(run_built(tmp_path, "sp", "sp", TwoLayer(IdData(47, 9), momentum=0.9)))
    out = run_built(tmp_path, accumulate, "fsdp", TwoLayer(IdData(47, 9), momentum=0.9),
                    fsdp={"accumulate": accumulate})
    assert_close(weights(out), ref)


def test_accumulate_must_be_full_or_sharded():
    from sailfin.config import ConfigError
    from sailfin.config.fsdp import FSDPArguments

    with pytest.raises(ConfigError, match="trainer.fsdp.accumulate must be full or sharded"):
        FSDPArguments(accumulate="shard")


def ema_weights(out):
    return load_file(str(out / "final" / "ema.safetensors"))


def test_ema_is_saved_as_shards_and_resumes_as_the_uninterrupted_run(tmp_path):
    from tests.checkpoint.helpers import Crash, CrashAt

    ema = {"decay": 0.8, "every_n_steps": 2}
    ref = ema_weights(run_built(tmp_path, "sp", "sp", TwoLayer(IdData(47, 9), momentum=0.9),
                               ema=ema))
    module = TwoLayer(IdData(47, 9), momentum=0.9)
    with Trainer(module, args(tmp_path / "run", backend="fsdp", ema=ema, **RUN),
                 callbacks=[CrashAt(5)]) as trainer:
        with pytest.raises(Crash):
            trainer.train()
    step = tmp_path / "run" / "checkpoints" / "step-00000003"
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["sharded"]["keys"] == ["callbacks/ema", "module", "optimizers"]
    assert "ema" not in torch.load(step / "trainer.pt", weights_only=True)["callbacks"]
    out = run_built(tmp_path, "run", "fsdp", TwoLayer(IdData(47, 9), momentum=0.9), ema=ema)
    assert_close(ema_weights(out), ref)
    # The same shards resume under sp, too.
    assert_close(weights(out), weights(tmp_path / "sp"))


def test_ema_after_init_from_starts_from_the_loaded_weights(tmp_path):
    run_built(tmp_path, "a", "sp", TwoLayer(IdData(47, 9)), epochs=1)
    loaded = tmp_path / "a" / "final" / "model.safetensors"
    out = run_built(tmp_path, "b", "fsdp", TwoLayer(IdData(47, 9)), epochs=1, max_steps=2,
                    init_from=str(loaded), ema={"decay": 0.5, "every_n_steps": 1000})
    assert_close(ema_weights(out), load_file(str(loaded)))  # no update yet: the start


def test_compile_under_fsdp_compiles_each_unit_then_shards(tmp_path):
    from torch.distributed.fsdp import FSDPModule

    module = TwoLayer(IdData(20, 0))
    with Trainer(module, args(tmp_path, backend="fsdp", compile=True, max_steps=1,
                              compile_mode="default")) as trainer:
        trainer.setup()
        units = [module.hidden, module.linear]
        assert all(isinstance(u, FSDPModule) and u._compiled_call_impl is not None
                   for u in units)
        assert trainer.backend.runner._compiled_call_impl is None  # the root runs eagerly


class InitInRecipe(TwoLayer):
    def __init__(self, data, **kw) -> None:
        super().__init__(data, **kw)
        nn.init.zeros_(self.linear.bias)  # outside an init method: cannot be deferred


CONFIG = """
data: {class_path: tests.recipes.IdData, init_args: {n_train: 47, n_val: 9}}
module: {class_path: MODULE, init_args: {momentum: 0.9}}
trainer: {epochs: 2, train_batch_size: 10, micro_batch_size: 5, max_grad_norm: 0.5,
          writers: [jsonl], output_dir: OUT, seed: 0}
"""


def test_sailfin_train_builds_on_meta_under_fsdp(tmp_path, capsys, monkeypatch):
    from sailfin.cli import main
    import sailfin.backends.deferred as deferred

    built = []
    real = deferred.deferred_build
    monkeypatch.setattr(deferred, "deferred_build",
                        lambda *a, **k: built.append(real(*a, **k)) or built[-1])

    def train(name, module, *overrides):
        path = tmp_path / f"{name}.yaml"
        path.write_text(CONFIG.replace("OUT", str(tmp_path / name)).replace("MODULE", module))
        code = main(["train", str(path), *overrides])
        return code, capsys.readouterr().err

    assert train("sp", "tests.backends.test_fsdp.TwoLayer")[0] == 0
    assert not built
    assert train("fsdp", "tests.backends.test_fsdp.TwoLayer", "--trainer.backend", "fsdp")[0] == 0
    assert len(built) == 1 and init_plan(built[0]) is None  # built on meta, then placed
    assert_close(weights(tmp_path / "fsdp"), weights(tmp_path / "sp"))
    code, err = train("bad", f"{__name__}.InitInRecipe", "--trainer.backend", "fsdp")
    assert code == 2 and "Traceback" not in err
    assert "test_fsdp_build.py" in err and "fills a parameter in place (zero_)" in err
    assert train("eager", f"{__name__}.InitInRecipe", "--trainer.backend", "fsdp",
                 "--trainer.fsdp.meta_build", "false")[0] == 0
    assert len(built) == 1  # meta_build false: built eagerly


@pytest.mark.cuda
def test_deferred_build_on_a_gpu_starts_from_the_eager_weights(tmp_path):
    eager, deferred = eager_and_deferred(Rich)
    with Trainer(deferred, args(tmp_path, backend="fsdp", device="cuda")) as trainer:
        trainer.setup()
        assert deferred.linear.weight.device.type == "cuda"
        got = trainer.backend.final_state_dict(deferred)
    for key, value in eager.state_dict().items():
        assert torch.equal(got[key].cpu(), value), key
