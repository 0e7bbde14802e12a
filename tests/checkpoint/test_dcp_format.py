"""One checkpoint format on every backend: one DCP save of the model, optimizers and
sailfin's small state, which torch opens alone; one checksum whatever the machine has
installed; the earlier formats (pickled sp checkpoints; the small state in files beside
the shards) still resume exactly."""

import importlib
import json
import shutil
import subprocess
import sys
import types
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sailfin import Trainer
from sailfin.checkpoint import shard_checksums
from tests.checkpoint.helpers import Crash, CrashAt, assert_same_params, params
from tests.recipes import IdData, LinearRecipe, args

FIXTURE = Path(__file__).parent / "fixtures" / "previous-format"
BESIDE = Path(__file__).parent / "fixtures" / "files-beside-shards"
CKPT = {"every_n_steps": 3, "keep_last": 1}

# Run in a process that never imports sailfin: torch's own converter, then the weights out.
TORCH_ALONE = """
import sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2])
assert not any(m.split('.')[0] == 'sailfin' for m in sys.modules), 'sailfin was imported'
state = torch.load(sys.argv[2], weights_only=True)
print(sorted(state))
"""


def convert_with_torch_alone(shards: Path, out: Path) -> dict:
    """``shards`` (a checkpoint's DCP directory) as one torch.save file, by torch alone."""
    done = subprocess.run([sys.executable, "-c", TORCH_ALONE, str(shards), str(out)],
                          capture_output=True, text=True, timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    return torch.load(out, weights_only=True)


def recipe():
    return LinearRecipe(IdData(47, 9), dropout=0.3, momentum=0.9)


def test_an_sp_checkpoint_opens_with_torch_alone(tmp_path):
    module = recipe()
    Trainer(module, args(tmp_path, epochs=2, checkpoint={**CKPT, "at_epoch_end": True})).train()
    ckpt = tmp_path / "checkpoints" / (tmp_path / "checkpoints" / "latest").read_text().strip()
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert "files" not in manifest and sorted(p.name for p in ckpt.iterdir()) == [
        "manifest.json", "shards"]  # everything is in the one DCP save
    assert manifest["sharded"]["keys"] == ["module", "optimizers"]
    assert sorted(manifest["sharded"]["entries"]) == ["rng/rank00000", "trainer"]
    assert {e["file"] for e in manifest["sharded"]["entries"].values()} == {"__0_0.distcp"}
    assert all(set(e) == {"size", "crc32"} for e in manifest["sharded"]["files"].values())
    state = convert_with_torch_alone(ckpt / "shards", tmp_path / "converted.pt")
    # What a user sees of sailfin's small state there: plain dicts (weights_only loads them).
    assert sorted(state) == ["module", "optimizers", "rng/rank00000", "trainer"]
    assert state["trainer"]["counters"]["global_step"] == manifest["step"]
    assert torch.equal(state["rng/rank00000"]["torch"], torch.load(
        tmp_path / "converted.pt", weights_only=True)["rng/rank00000"]["torch"])
    final = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert sorted(state["module"]) == sorted(final)
    for name, value in final.items():
        assert torch.equal(state["module"][name], value), name
    # The optimizer state under parameter names: momentum buffers of the trained run.
    momentum = state["optimizers"]["0"]["state"]["linear.weight"]["momentum_buffer"]
    assert torch.is_tensor(momentum) and momentum.abs().sum() > 0


def test_a_checkpoint_of_the_previous_format_resumes_exactly(tmp_path):
    """The fixture (model.pt, trainer.pt: written by the previous release, see its
    make_fixture.py) loads exactly the tensors it holds, and training on from it gives
    what training on from the same tensors, put back through Trainer.load_state_dict,
    gives. Both runs here: the fixture was made on another CPU, so no run made there
    (nor one started from scratch here) is a bit-for-bit reference."""
    import random

    import numpy as np

    saved = FIXTURE / "step-00000006"
    model = torch.load(saved / "model.pt", weights_only=True)  # read by torch alone
    state = torch.load(saved / "trainer.pt", weights_only=True)
    rng = torch.load(saved / "rng-rank00000.pt", weights_only=True)

    out = tmp_path / "run"
    shutil.copytree(FIXTURE, out / "checkpoints", ignore=shutil.ignore_patterns("*.py"))
    assert (out / "checkpoints" / "step-00000006" / "model.pt").is_file()
    module = recipe()
    trainer = Trainer(module, args(out, epochs=2, checkpoint=CKPT))
    trainer.setup()  # the resume
    assert trainer.resumed_from.name == "step-00000006"
    loaded = dict(module.named_parameters())
    assert sorted(loaded) == sorted(model)
    for name, value in model.items():
        assert torch.equal(loaded[name].detach(), value), name
    momentum = trainer.optimizers[0].state_dict()["state"]
    for key, entry in state["optimizers"][0]["state"].items():
        assert torch.equal(momentum[key]["momentum_buffer"], entry["momentum_buffer"]), key
    assert (trainer.global_step, trainer.epoch, trainer.step_in_epoch) == (6, 1, 1)
    trainer.train()
    trainer.close()

    # The same tensors another way: a run set up afresh, then given them by hand.
    other = recipe()
    again = Trainer(other, args(tmp_path / "by-hand", epochs=2, checkpoint=CKPT))
    again.setup()
    assert again.resumed_from is None and again.global_step == 0
    again.load_state_dict({**state, "module": model})
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    drawn = rng["numpy"]
    np.random.set_state({"bit_generator": drawn["bit_generator"],
                         "state": {"key": drawn["key"].numpy().astype(np.uint32),
                                   "pos": drawn["pos"]},
                         "has_gauss": drawn["has_gauss"], "gauss": drawn["gauss"]})
    torch.set_rng_state(rng["torch"])
    again.train()
    again.close()
    assert again.global_step == trainer.global_step == 10
    assert_same_params(params(module), params(other))
    # Its next save is in the one format.
    newest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    assert (newest / "shards" / ".metadata").is_file() and not (newest / "model.pt").exists()


def test_a_checkpoint_with_its_small_state_beside_the_shards_resumes(tmp_path):
    """The fixture (written by the release before this one, see its make_fixture.py):
    trainer.pt and rng-rank00000.pt beside the shards, listed in the manifest. The resume
    puts back exactly the tensors, counters and random streams they hold; the next save is
    in this release's format (everything in the one DCP save)."""
    import torch.distributed.checkpoint as dcp

    saved = BESIDE / "step-00000006"
    state = torch.load(saved / "trainer.pt", weights_only=True)  # read by torch alone
    rng = torch.load(saved / "rng-rank00000.pt", weights_only=True)
    out = tmp_path / "run"
    shutil.copytree(BESIDE, out / "checkpoints", ignore=shutil.ignore_patterns("*.py"))
    module = recipe()
    shards = {"module": {k: torch.empty_like(v) for k, v in module.state_dict().items()}}
    dcp.load(shards, checkpoint_id=str(saved / "shards"), no_dist=True)
    trainer = Trainer(module, args(out, epochs=2, checkpoint=CKPT))
    trainer.setup()  # the resume
    assert trainer.resumed_from.name == "step-00000006"
    assert (trainer.global_step, trainer.epoch, trainer.step_in_epoch) == (6, 1, 1)
    assert state["counters"]["global_step"] == 6
    for name, value in module.state_dict().items():
        assert torch.equal(value, shards["module"][name]), name
    assert torch.equal(torch.get_rng_state(), rng["torch"])
    trainer.train()
    trainer.close()
    assert trainer.global_step == 10
    newest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["format"] == "sailfin-checkpoint/3" and "files" not in manifest
    assert not (newest / "trainer.pt").exists() and not (newest / "rng-rank00000.pt").exists()


def fake_crc32c() -> types.ModuleType:
    """A stand-in for google-crc32c (a dependency of gcsfs): an older sailfin switched its
    checksums to CRC-32C whenever such a package could be imported."""
    module = types.ModuleType("google_crc32c")
    module.extend = lambda crc, data: zlib.crc32(data, crc ^ 0x5A5A5A5A) ^ 0x5A5A5A5A
    return module


def test_a_checkpoint_saved_with_crc32c_importable_resumes_without_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "google_crc32c", fake_crc32c())
    importlib.reload(shard_checksums)  # whatever it would pick at import, with the package
    try:
        Trainer(recipe(), args(tmp_path, epochs=2, checkpoint=CKPT),
                callbacks=[CrashAt(8)]).train()
    except Crash:
        pass
    monkeypatch.delitem(sys.modules, "google_crc32c")
    importlib.reload(shard_checksums)
    manifest = json.loads((tmp_path / "checkpoints" / "step-00000006" / "manifest.json")
                          .read_text())
    assert all("crc32" in e and "crc32c" not in e for e in manifest["sharded"]["files"].values())
    trainer = Trainer(recipe(), args(tmp_path, epochs=2, checkpoint=CKPT))
    trainer.train()
    assert trainer.resumed_from.name == "step-00000006"  # the newest, not a fallback


class FrozenBase(LinearRecipe):
    """A frozen 'base' (a wide projection) under a small head that trains: the shape of a
    parameter-efficient fine-tune. ``base_seed`` picks the base's weights."""

    checkpoint_frozen_params = False

    def __init__(self, data, base_seed: int = 1, **kw):
        super().__init__(data, **kw)
        self.base = torch.nn.Linear(4, 4)
        with torch.no_grad():
            self.base.weight.copy_(torch.randn(4, 4, generator=torch.Generator().manual_seed(
                base_seed)))
        self.base.requires_grad_(False)

    def forward(self, x):
        return super().forward(self.base(x))

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        opt = torch.optim.SGD([p for p in self.parameters() if p.requires_grad],
                              lr=self.lr, momentum=self.momentum)
        return [opt], []


def frozen_run(out, crash_at=None, **kw):
    module = FrozenBase(IdData(47, 9), dropout=0.3, momentum=0.9, **kw)
    trainer = Trainer(module, args(out, epochs=2, checkpoint=CKPT),
                      callbacks=[CrashAt(crash_at)] if crash_at else [])
    try:
        trainer.train()
    except Crash:
        pass
    return module, trainer


def test_a_checkpoint_without_the_frozen_base_resumes_exactly_and_only_onto_it(tmp_path):
    import torch.distributed.checkpoint as dcp

    from sailfin.checkpoint import CheckpointError

    ref, _ = frozen_run(tmp_path / "ref")
    frozen_run(tmp_path / "run", crash_at=8)
    shards = tmp_path / "run" / "checkpoints" / "step-00000006" / "shards"
    names = set(dcp.FileSystemReader(str(shards)).read_metadata().state_dict_metadata)
    assert {"module.linear.weight", "module.linear.bias"} <= names
    assert not any(n.startswith("module.base.") for n in names)  # the base stays out
    with pytest.raises(CheckpointError, match="another frozen base: frozen parameter "
                                              "base.weight differs"):
        frozen_run(tmp_path / "run", base_seed=2)
    module, trainer = frozen_run(tmp_path / "run")
    assert trainer.resumed_from.name == "step-00000006"
    assert_same_params(params(ref), params(module))


def test_a_checkpoint_of_the_previous_format_serves_as_init_from(tmp_path):
    saved = torch.load(FIXTURE / "step-00000006" / "model.pt", weights_only=True)
    module = recipe()
    trainer = Trainer(module, args(tmp_path, epochs=1, max_steps=1,
                                   init_from=str(FIXTURE / "step-00000006")))
    trainer.setup()
    for name, value in saved.items():
        assert torch.equal(module.state_dict()[name], value), name
    trainer.close()
