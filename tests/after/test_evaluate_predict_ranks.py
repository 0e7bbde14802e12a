"""evaluate and predict on 2 ddp and 2 fsdp processes (and ddp-amp): the metrics and
rows, in the same order, of one process over the same checkpoint; odd-sized splits
(37 and 23 samples) count every sample once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sailfin import Trainer, load_config
from tests.after.runs import CONFIG, trained
from tests.distributed.harness import errors, run_ranks

pytestmark = pytest.mark.slow


def evaluate_and_predict(rank: int, world: int, dist_args, out: Path, backend: str,
                         run: str) -> None:
    cfg = load_config(CONFIG, ["--trainer.output_dir", str(out / backend),
                               "--trainer.backend", backend])
    cfg.trainer.distributed = dist_args
    def sharded(cls, **kwargs):  # as sailfin train builds under fsdp: the data as usual
        from sailfin.backends.fsdp_build import sharded_build

        with sharded_build(rank, cfg.trainer.fsdp.build):
            return cls(**kwargs)

    module = cfg.build(sharded if backend.startswith("fsdp") else None)
    with Trainer(module, cfg.trainer) as trainer:
        for split in ("val", "test"):
            result = trainer.evaluate(checkpoint=str(Path(run) / "checkpoints" / "best"),
                                      split=split)
            if rank == 0:
                Path(out, f"{backend}-{split}.json").write_text(json.dumps(result))
        trainer.predict(str(out / f"{backend}-test.jsonl"), split="test")


def single(tmp_path: Path, run: Path) -> tuple[dict, list]:
    cfg = load_config(CONFIG, ["--trainer.output_dir", str(tmp_path / "sp")])
    with Trainer(cfg.build(), cfg.trainer) as trainer:
        metrics = {s: trainer.evaluate(checkpoint=str(run / "checkpoints" / "best"), split=s)
                   for s in ("val", "test")}
        trainer.predict(str(tmp_path / "sp.jsonl"), split="test")
    return metrics, (tmp_path / "sp.jsonl").read_text().splitlines()


@pytest.mark.parametrize("backend", ["ddp", "fsdp", "ddp-amp"])
def test_two_processes_give_one_process_metrics_and_rows(tmp_path, backend):
    run = trained(tmp_path / "run")
    one, rows = single(tmp_path, run)
    codes = run_ranks(evaluate_and_predict, 2, tmp_path, timeout=240, backend=backend,
                      run=str(run))
    assert codes == [0, 0], errors(tmp_path)
    for split, count in (("val", 37), ("test", 23)):
        two = json.loads((tmp_path / f"{backend}-{split}.json").read_text())
        assert two["world_size"] == 2 and two["samples"] == one[split]["samples"] == count
        assert two["metrics"]["count"] == count
        assert two["metrics"]["positions"] == sum(range(count))  # each sample once
        for key, value in one[split]["metrics"].items():
            # ddp-amp on CPU runs bfloat16 autocast: close, not equal
            tol = 0.05 if backend.endswith("amp") else 1e-5
            assert two["metrics"][key] == pytest.approx(value, rel=tol, abs=tol), key
    theirs = [json.loads(r) for r in (tmp_path / f"{backend}-test.jsonl").read_text().splitlines()]
    ours = [json.loads(r) for r in rows]
    assert [r["id"] for r in theirs] == [r["position"] for r in theirs] == list(range(23))
    if not backend.endswith("amp"):
        assert [r["label"] for r in theirs] == [r["label"] for r in ours]
        for a, b in zip(theirs, ours):
            assert a["logits"] == pytest.approx(b["logits"], rel=1e-5, abs=1e-6)


def train_sharded(rank: int, world: int, dist_args, out: Path) -> None:
    cfg = load_config(CONFIG, ["--trainer.output_dir", str(out / "fsdp-run"),
                               "--trainer.backend", "fsdp"])
    cfg.trainer.distributed = dist_args

    def sharded(cls, **kwargs):
        from sailfin.backends.fsdp_build import sharded_build

        with sharded_build(rank, cfg.trainer.fsdp.build):
            return cls(**kwargs)

    with Trainer(cfg.build(sharded), cfg.trainer) as trainer:
        trainer.train()


def test_fsdp_writes_the_bare_weights_gathered_under_the_models_own_names(tmp_path):
    import torch
    from safetensors.torch import load_file
    from torch import nn

    codes = run_ranks(train_sharded, 2, tmp_path, timeout=240)
    assert codes == [0, 0], errors(tmp_path)
    final = tmp_path / "fsdp-run" / "final"
    bare = load_file(str(final / "bare.safetensors"))
    recipe = load_file(str(final / "model.safetensors"))
    assert set(recipe) == {f"net.{k}" for k in bare}
    assert all(torch.equal(recipe[f"net.{k}"], v) for k, v in bare.items())
    net = nn.Sequential(nn.Linear(5, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    net.load_state_dict(bare)
