"""fsdp in one process: the build by contract (rank 0 builds as sp does, shards are
filled from it; opt-in: init_weights() on the sharded model), the units and their errors,
init_from of every source into every backend, both accumulation modes, EMA, compile."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from sailfin import Trainer, sharded_build
from sailfin.backends.fsdp_units import default_unit_classes, select_units
from sailfin.checkpoint import CheckpointError
from sailfin.config import ConfigError
from tests.backends.test_fsdp import RUN, TwoLayer, assert_close, weights
from tests.checkpoint.helpers import small_state
from tests.recipes import IdData, WideRecipe, args


class Rich(WideRecipe):
    """What a recipe's own code does to its weights: torch layers' reset_parameters, an
    init filled in place in __init__, a tie, a parameter from a factory, a persistent
    buffer, a non-persistent buffer and a plain tensor attribute."""

    def __init__(self, data, **kw) -> None:
        super().__init__(data, **kw)
        self.norm = nn.LayerNorm(32)
        self.attn = nn.MultiheadAttention(32, 4)
        self.emb = nn.Embedding(10, 32)
        self.out = nn.Linear(32, 10, bias=False)
        self.out.weight = self.emb.weight  # tied
        nn.init.normal_(self.emb.weight, std=0.02)  # in __init__, after the tie
        nn.init.zeros_(self.linear.bias)
        self.gain = nn.Parameter(torch.ones(1))
        self.register_buffer("pos", torch.arange(5).float())
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)), persistent=False)
        self.table = torch.randn(3)  # a plain attribute


def built(cls, rank=0, build="rank0", seed=0):
    data = IdData(20, 0)  # outside: the data interface is built for real on every rank
    torch.manual_seed(seed)
    with sharded_build(rank, build):
        return cls(data)


def test_sharded_build_is_real_on_rank_0_and_meta_elsewhere():
    assert not built(Rich).linear.weight.is_meta
    other = built(Rich, rank=1)
    assert other.linear.weight.is_meta and other.mask.is_meta and other.table.is_meta
    assert other.out.weight is other.emb.weight  # ties are made on meta, too
    assert built(Rich, build="meta").linear.weight.is_meta


@pytest.mark.parametrize("backend", ["sp", "fsdp"])
def test_fsdp_starts_from_the_weights_sp_builds(tmp_path, backend):
    ref = built(Rich)
    module = built(Rich)
    with Trainer(module, args(tmp_path, backend=backend)) as trainer:
        trainer.setup()
        got = trainer.backend.final_state_dict(module)
        assert torch.equal(module.mask, ref.mask) and torch.equal(module.table, ref.table)
        assert module.out.weight is module.emb.weight  # still one parameter
    assert got.keys() == ref.state_dict().keys()
    for key, value in ref.state_dict().items():
        assert torch.equal(got[key], value), key


def test_a_run_built_by_rank_0_trains_as_sp(tmp_path):
    ref = weights(run_built(tmp_path, "sp", "sp", TwoLayer(IdData(47, 9), momentum=0.9)))
    data = IdData(47, 9)
    with sharded_build(0):
        module = TwoLayer(data, momentum=0.9)
    assert_close(weights(run_built(tmp_path, "fsdp", "fsdp", module)), ref)


def run_built(tmp_path, name, backend, module, **kw):
    with Trainer(module, args(tmp_path / name, backend=backend, **{**RUN, **kw})) as t:
        t.train()
    return tmp_path / name


# -- build: meta, the init_weights() contract ----------------------------------------------
class SelfInit(TwoLayer):
    def init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.1, a=-0.2, b=0.2)
                nn.init.zeros_(m.bias)
        nn.init.ones_(self.gain)


def meta_start(tmp_path, name, recipe=SelfInit, seed=0):
    module = built(recipe, build="meta")
    with Trainer(module, args(tmp_path / name, backend="fsdp", seed=seed,
                              fsdp={"build": "meta"})) as trainer:
        trainer.setup()
        return {k: v.clone() for k, v in trainer.backend.final_state_dict(module).items()}


def test_meta_build_runs_init_weights_on_the_shards_deterministically(tmp_path):
    first, again = meta_start(tmp_path, "a"), meta_start(tmp_path, "b")
    other_seed = meta_start(tmp_path, "c", seed=1)
    for key, value in first.items():
        assert torch.equal(value, again[key]), key
    assert torch.equal(first["linear.bias"], torch.zeros(1))  # init_weights' own values
    assert torch.equal(first["gain"], torch.ones(1))
    assert 0 < first["hidden.0.weight"].abs().max() <= 0.2  # init_weights' bounds
    assert not torch.equal(first["hidden.0.weight"], other_seed["hidden.0.weight"])


def test_meta_build_without_init_weights_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.fsdp.build is meta, but TwoLayer has no "
                                          r"init_weights\(\).*set trainer.fsdp.build rank0"):
        meta_start(tmp_path, "a", recipe=TwoLayer)
    with pytest.raises(ConfigError, match="trainer.fsdp.build must be rank0 or meta"):
        args(tmp_path, backend="fsdp", fsdp={"build": "lazy"})


# -- units ---------------------------------------------------------------------------------
class GPT(TwoLayer):
    """nanoGPT's layout: blocks in a ModuleList, embedding tied to the head."""

    def __init__(self, data, **kw) -> None:
        super().__init__(data, **kw)
        self.wte = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3))
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.wte.weight


def test_default_units_are_the_blocks_and_never_split_a_tie():
    gpt = GPT(IdData(4, 0))
    assert default_unit_classes(gpt) == ["Sequential"]
    assert [n for n, _ in select_units(gpt, None)] == [  # innermost first
        "blocks.0", "blocks.1", "blocks.2", "hidden"]
    gpt._no_split_modules = ["Embedding", "Absent"]  # declared: used as far as present
    assert default_unit_classes(gpt) == ["Embedding"]
    assert select_units(gpt, None) == []  # wte is tied to head, outside it: the root keeps it


def test_a_unit_fsdp_cannot_use_is_one_line_naming_it():
    gpt = GPT(IdData(4, 0))
    with pytest.raises(ConfigError, match=r"trainer.fsdp.units\[0\] \('blocks'\) takes blocks, "
                                          r"a ModuleList without forward.*\(Sequential\)"):
        select_units(gpt, ["blocks"])
    with pytest.raises(ConfigError, match=r"trainer.fsdp.units\[1\] \('wte'\) takes wte, whose "
                                          r"parameter wte.weight is tied to head outside it"):
        select_units(gpt, ["blocks.0", "wte"])


def test_a_model_every_rank_must_build_alike_is_checked_before_sharding(tmp_path):
    from sailfin.backends.fsdp_build import check_same_model

    theirs = [("weight", (1, 32), "torch.float32"), ("bias", (1,), "torch.float32")]
    with pytest.raises(ConfigError, match=r"rank 1 built weight as \[1, 8\] torch.float32, "
                                          r"rank 0 as \[1, 32\] torch.float32: under fsdp"):
        check_same_model(TwoLayer(IdData(4, 0)).linear, 1, lambda mine: theirs)


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
    if manifest is None:  # a directory of checkpoints: its newest
        source = sorted(source.glob("step-*"))[-1]
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
    with pytest.raises(CheckpointError, match=r"init_from: the weights in .*step-00000003 do "
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
    assert "ema" not in small_state(step)[0]["callbacks"]
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
        units = [module.hidden[0], module.linear]  # the default units: Linear
        assert all(isinstance(u, FSDPModule) and u._compiled_call_impl is not None
                   for u in units)
        assert trainer.backend.runner._compiled_call_impl is None  # the root runs eagerly



CONFIG = """
data: {class_path: tests.recipes.IdData, init_args: {n_train: 47, n_val: 9}}
module: {class_path: MODULE, init_args: {momentum: 0.9}}
trainer: {epochs: 2, train_batch_size: 10, micro_batch_size: 5, max_grad_norm: 0.5,
          writers: [jsonl], output_dir: OUT, seed: 0}
"""


class InitInRecipe(TwoLayer):
    def __init__(self, data, **kw) -> None:
        super().__init__(data, **kw)
        nn.init.normal_(self.linear.weight)  # a recipe's own init, in __init__


def test_sailfin_train_under_fsdp_starts_from_sp_weights(tmp_path, capsys):
    from sailfin.cli import main

    def train(name, *overrides):
        path = tmp_path / f"{name}.yaml"
        path.write_text(CONFIG.replace("OUT", str(tmp_path / name))
                        .replace("MODULE", f"{__name__}.InitInRecipe"))
        assert main(["train", str(path), *overrides]) == 0, capsys.readouterr().err

    train("sp")
    train("fsdp", "--trainer.backend", "fsdp")
    assert_close(weights(tmp_path / "fsdp"), weights(tmp_path / "sp"))


@pytest.mark.cuda
def test_fsdp_on_a_gpu_starts_from_the_weights_sp_builds(tmp_path):
    ref = built(Rich)
    module = built(Rich)
    with Trainer(module, args(tmp_path, backend="fsdp", device="cuda")) as trainer:
        trainer.setup()
        assert module.linear.weight.device.type == "cuda"
        assert module.mask.device.type == "cuda"
        got = trainer.backend.final_state_dict(module)
    for key, value in ref.state_dict().items():
        assert torch.equal(got[key].cpu(), value), key


def test_the_private_fsdp_attributes_sailfin_uses_are_present():
    from sailfin.compat.fsdp import missing

    assert missing() == []
