"""The fsdp backends in one process (a group of one): same training as sp, sharded
checkpoints that resume under sp and back, units, and config errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from sailfin import Trainer
from sailfin.backends.fsdp import select_units
from sailfin.config import ConfigError
from sailfin.checkpoint import Checkpointer
from sailfin.config.fsdp import FSDPArguments
from tests.checkpoint.helpers import Crash, CrashAt, small_state
from tests.recipes import IdData, LinearRecipe, args

# 47 samples, global 10 in micro-batches of 5: accumulation 2, the last step 7 samples.
RUN = dict(epochs=2, train_batch_size=10, micro_batch_size=5, max_grad_norm=0.5,
           checkpoint={"every_n_steps": 3})


class TwoLayer(LinearRecipe):
    """Two units and a parameter of the root's own."""

    def __init__(self, data, **kw) -> None:
        super().__init__(data, **kw)
        torch.manual_seed(0)
        self.hidden = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.linear = nn.Linear(8, 1)
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.linear(self.hidden(x)).squeeze(-1) * self.gain


def run(tmp_path, name, backend, crash_at=None, recipe=TwoLayer, **kw):
    module = recipe(IdData(47, 9), momentum=0.9)
    callbacks = [CrashAt(crash_at)] if crash_at else []
    with Trainer(module, args(tmp_path / name, backend=backend, **{**RUN, **kw}),
                 callbacks=callbacks) as trainer:
        if crash_at:
            with pytest.raises(Crash):
                trainer.train()
        else:
            trainer.train()
    return tmp_path / name


def weights(out):
    return load_file(str(out / "final" / "model.safetensors"))


def assert_close(a, b):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)


def test_fsdp_alone_trains_as_sp_and_saves_plain_final_weights(tmp_path, capfd):
    ref = run(tmp_path, "sp", "sp")
    capfd.readouterr()
    out = run(tmp_path, "fsdp", "fsdp")
    said = capfd.readouterr()
    # One process shards nothing: the start says which backend is faster, once.
    assert (said.out + said.err).count("fsdp in one process shards nothing") == 1
    got = weights(out)
    # Plain names (no runner or wrapper prefix), full tensors, loadable anywhere.
    assert sorted(got) == ["gain", "hidden.0.bias", "hidden.0.weight", "linear.bias",
                           "linear.weight"]
    assert_close(got, weights(ref))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["global_step"] == 10


def test_fsdp_checkpoint_is_sharded_and_listed_in_the_manifest(tmp_path):
    # A killed save of step 10 on more ranks left a shard behind: it must not survive.
    stale = tmp_path / "fsdp" / "checkpoints" / ".tmp-step-00000010" / "shards"
    stale.mkdir(parents=True)
    (stale / "__7_0.distcp").write_bytes(b"old")
    out = run(tmp_path, "fsdp", "fsdp")
    step = out / "checkpoints" / "step-00000010"
    assert not (step / "shards" / "__7_0.distcp").exists()
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["sharded"]["format"] == "torch-dcp/1"
    assert manifest["sharded"]["keys"] == ["module", "optimizers"]
    assert set(manifest["sharded"]["files"]) == {".metadata", "__0_0.distcp"}
    assert "files" not in manifest  # the model and the small state are in the shards only
    assert sorted(manifest["sharded"]["entries"]) == ["rng/rank00000", "trainer"]
    trainer_state = small_state(step)[0]
    assert "optimizers" not in trainer_state and "counters" in trainer_state


@pytest.mark.parametrize("first,then", [("fsdp", "sp"), ("sp", "fsdp"), ("fsdp", "fsdp")])
def test_resume_across_backends(tmp_path, capfd, first, then):
    """Crash at step 4 (checkpoint at 3) under one backend, resume under the other:
    the same weights and step count as an uninterrupted sp run."""
    ref = weights(run(tmp_path, "ref", "sp"))
    run(tmp_path, "run", first, crash_at=4)
    capfd.readouterr()
    out = run(tmp_path, "run", then)
    assert "step-00000003: step 3" in capfd.readouterr().err  # resumed, not started afresh
    assert_close(weights(out), ref)
    assert json.loads((out / "summary.json").read_text())["global_step"] == 10


def test_async_save_under_fsdp_resumes(tmp_path):
    ref = weights(run(tmp_path, "ref", "sp"))
    checkpoint = {"every_n_steps": 3, "async_save": True}
    run(tmp_path, "run", "fsdp", crash_at=7, checkpoint=checkpoint)
    assert (tmp_path / "run" / "checkpoints" / "step-00000006" / "shards" / ".metadata").exists()
    out = run(tmp_path, "run", "fsdp", checkpoint=checkpoint)
    assert_close(weights(out), ref)


def test_damaged_shard_falls_back_to_the_previous_checkpoint(tmp_path):
    run(tmp_path, "run", "fsdp", crash_at=7)
    shard = tmp_path / "run" / "checkpoints" / "step-00000006" / "shards" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    ref = weights(run(tmp_path, "ref", "sp"))
    out = run(tmp_path, "run", "fsdp")
    assert_close(weights(out), ref)  # resumed from step 3


def test_units_by_class_path_and_default():
    module = TwoLayer(IdData(4, 0))
    # Default: the class of the children of the largest Sequential (Linear), everywhere.
    assert [n for n, _ in select_units(module, None)] == ["hidden.0", "linear"]
    assert [n for n, _ in select_units(module, ["Linear"])] == ["hidden.0", "linear"]
    assert [n for n, _ in select_units(module, ["hidden", "hidden.0"])] == ["hidden.0", "hidden"]
    with pytest.raises(ConfigError, match=r"units\[0\] is 'Linaer'.*Linear"):
        select_units(module, ["Linaer"])


def test_fsdp_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="trainer.fsdp.units must be a list"):
        FSDPArguments(units="Block")
    with pytest.raises(ConfigError, match="cpu_offload"):
        Trainer(TwoLayer(IdData(4, 0)), args(tmp_path, backend="fsdp", device="cpu",
                                               fsdp={"cpu_offload": True}))


class SelfSharding(TwoLayer):
    def configure_sharding(self, shard):
        self.sharded_here = [shard(self.hidden)]


def test_recipe_shards_itself(tmp_path):
    module = SelfSharding(IdData(20, 0))
    with Trainer(module, args(tmp_path, backend="fsdp", epochs=1)) as trainer:
        trainer.train()
        assert trainer.backend.units == ["hidden"]


def test_fsdp_with_activation_checkpointing_trains_as_sp(tmp_path):
    ref = weights(run(tmp_path, "sp", "sp"))
    out = run(tmp_path, "fsdp", "fsdp", activation_checkpointing=["Sequential"],
              fsdp={"units": ["Sequential", "linear"], "reshard_after_forward": False})
    assert_close(weights(out), ref)


@pytest.mark.slow
def test_fsdp_compiled_trains_as_sp(tmp_path):
    ref = weights(run(tmp_path, "sp", "sp"))
    assert_close(weights(run(tmp_path, "fsdp", "fsdp", compile=True)), ref)


def test_fsdp_amp_float16_trains_with_the_grad_scaler(tmp_path):
    out = run(tmp_path, "fp16", "fsdp-amp", amp_dtype="float16", max_grad_norm=None)
    got = weights(out)
    assert all(torch.isfinite(v).all() for v in got.values())
    assert got["linear.weight"].dtype == torch.float32  # sharded master weights stay fp32


def test_sharded_checkpoint_on_an_fsspec_url(tmp_path, capfd):
    """DCP's fsspec writer and reader under the same protocol (memory:// here)."""
    fsspec = pytest.importorskip("fsspec")
    import uuid

    root = f"sailfin-{uuid.uuid4().hex}/ckpt"
    ref = weights(run(tmp_path, "ref", "sp"))
    checkpoint = {"every_n_steps": 3, "dir": f"memory://{root}"}
    run(tmp_path, "run", "fsdp", crash_at=4, checkpoint=checkpoint)
    fs = fsspec.filesystem("memory")
    assert fs.exists(f"/{root}/step-00000003/shards/.metadata")
    capfd.readouterr()
    run(tmp_path, "run", "fsdp", checkpoint=checkpoint)
    assert "resuming from memory://" in capfd.readouterr().err
    assert_close(weights(tmp_path / "run"), ref)
    fs.rm(f"/{root.split('/')[0]}", recursive=True)


def test_fsdp_section_from_the_command_line():
    from sailfin.config.loader import apply_override, from_dict

    raw = {"module": {"class_path": "tests.recipes.LinearRecipe"},
           "data": {"class_path": "tests.recipes.IdData"}, "trainer": {"backend": "fsdp"}}
    apply_override(raw, "trainer.fsdp.units", "[Block, encoder.layers.0]")
    apply_override(raw, "trainer.fsdp.reshard_after_forward", "false")
    fsdp = from_dict(raw).trainer.fsdp
    assert fsdp.units == ["Block", "encoder.layers.0"] and not fsdp.reshard_after_forward
    raw["trainer"]["fsdp"]["unit"] = ["Block"]
    with pytest.raises(ConfigError, match="trainer.fsdp.unit' \\(did you mean 'units'"):
        from_dict(raw)


class KeepsNothing(Checkpointer):
    """A checkpointer of its own that knows nothing of shards."""

    def save(self, snapshot):
        pass

    def latest(self):
        return None

    def load(self, name):
        raise AssertionError("not called")


@pytest.mark.parametrize("backend", ["sp", "fsdp"])
def test_a_checkpointer_without_shard_support_is_refused(tmp_path, backend):
    from sailfin.checkpoint import CheckpointError

    checkpoint = {"every_n_steps": 1, "class_path": f"{__name__}.KeepsNothing"}
    with pytest.raises(CheckpointError, match="KeepsNothing cannot write the model's state "
                                              "with DCP"):
        run(tmp_path, "run", backend, checkpoint=checkpoint)


def test_nonfinite_skip_under_fsdp_matches_sp(tmp_path):
    from tests.trainer.test_nonfinite import NanAt, NonFiniteLossWarning

    def train(name, backend):
        module = NanAt(IdData(60, 0), bad_steps={2, 4})
        with Trainer(module, args(tmp_path / name, backend=backend, train_batch_size=10,
                                  micro_batch_size=5, on_nonfinite="skip")) as trainer:
            with pytest.warns(NonFiniteLossWarning):
                summary = trainer.train()
        assert summary["nonfinite_steps"] == 2 and summary["global_step"] == 6
        return weights(tmp_path / name)

    assert_close(train("fsdp", "fsdp"), train("sp", "sp"))


def test_shards_of_another_model_name_the_key(tmp_path):
    from sailfin.checkpoint import CheckpointError

    run(tmp_path, "run", "fsdp", epochs=1)
    with pytest.raises(CheckpointError, match=r"do not fit this model: rank 0: ValueError: "
                                              r"Size mismatch .* for module\.linear\.weight"):
        run(tmp_path, "run", "fsdp", recipe=LinearRecipe)
