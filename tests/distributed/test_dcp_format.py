"""One checkpoint format on 2 processes: the newest checkpoint of a ddp and of an fsdp run
is a DCP directory that torch alone (no sailfin imported) turns into the final weights,
each tensor once (ddp's replicated state is written by one rank, not by both), with
sailfin's small state beside them: the trainer's once, each rank's random streams."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.checkpoint.test_dcp_format import convert_with_torch_alone
from tests.distributed.test_ddp import ddp

pytestmark = pytest.mark.slow

DATA = {"n_train": 103, "n_val": 0}
TRAINER = {"epochs": 2, "train_batch_size": 12, "micro_batch_size": 3,
           "checkpoint": {"at_epoch_end": True}}
RECIPE = {"momentum": 0.9, "hidden": 32}


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_the_newest_checkpoint_converts_with_torch_alone(tmp_path, backend):
    ddp(tmp_path, DATA, {**TRAINER, "backend": backend}, RECIPE, kind="wide")
    run = tmp_path / "ddp" / "run"
    newest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and "files" not in manifest  # all in the shards
    # The trainer's state once, from rank 0; each rank's random streams in its own file.
    assert {k: e["file"] for k, e in manifest["sharded"]["entries"].items()} == {
        "trainer": "__0_0.distcp", "rng/rank00000": "__0_0.distcp",
        "rng/rank00001": "__1_0.distcp"}
    state = convert_with_torch_alone(newest / "shards", tmp_path / "converted.pt")
    assert sorted(state) == ["module", "optimizers", "rng/rank00000", "rng/rank00001",
                             "trainer"]
    assert state["trainer"]["counters"]["global_step"] == manifest["step"]
    assert not torch.equal(state["rng/rank00000"]["torch"], state["rng/rank00001"]["torch"])
    final = load_file(str(run / "final" / "model.safetensors"))
    assert sorted(state["module"]) == sorted(final)
    for name, value in final.items():
        assert torch.equal(state["module"][name], value), name
    # Every parameter's momentum, whole, under its name.
    momentum = state["optimizers"]["0"]["state"]
    assert {f"{n}" for n in momentum} == set(final)
    for name, value in final.items():
        assert momentum[name]["momentum_buffer"].shape == value.shape
    # Each item is written once: the data files hold exactly the bytes DCP's index points
    # at (ddp's replicated tensors written by both ranks would leave twice as many).
    import torch.distributed.checkpoint as dcp

    indexed = dcp.FileSystemReader(str(newest / "shards")).read_metadata().storage_data
    written = sum(entry["size"] for name, entry in manifest["sharded"]["files"].items()
                  if name.endswith(".distcp"))
    assert sum(info.length for info in indexed.values()) == written


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
@pytest.mark.parametrize("forged", ["index", "trainer entry"])
def test_a_forgery_is_refused_by_every_rank_under_init_from(tmp_path, backend, forged):
    """A forged ``.metadata`` or trainer entry (the manifest matching it) under 2-process
    init_from: each rank checks the index's checksum, then reads it with the allow-list,
    and reads the trainer's entry with ``weights_only``: both refuse it, and no rank runs
    the payload."""
    from tests.checkpoint.forge import forge_metadata, forge_trainer_entry
    from tests.distributed.harness import errors, run_ranks
    from tests.distributed.workers import train

    ddp(tmp_path, DATA, {**TRAINER, "backend": backend}, RECIPE, kind="wide")
    run = tmp_path / "ddp" / "run"
    newest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    marker = tmp_path / "marker"
    (forge_metadata if forged == "index" else forge_trainer_entry)(newest, marker)
    out = tmp_path / "again"
    out.mkdir()
    codes = run_ranks(train, 2, out, data=DATA, recipe=RECIPE, kind="wide",
                      trainer={**TRAINER, "backend": backend, "init_from": str(newest)})
    said = errors(out)
    assert codes != [0, 0] and sorted(said) == [0, 1], said
    for text in said.values():
        first = text.splitlines()[0]
        said = (".metadata is not DCP's" if forged == "index" else
                "(entry 'trainer') holds a value that only arbitrary unpickling")
        assert first.startswith("CheckpointCorrupt: ") and said in first, first
    assert not marker.exists()
