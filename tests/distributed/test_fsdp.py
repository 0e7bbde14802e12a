"""fsdp on 2 CPU processes (gloo): the same training as ddp and sp, state really sharded,
kill -9 and resume on another world size or from a ddp checkpoint, elastic restarts."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from sailfin import Trainer
from sailfin.cli import main
from tests.distributed.elastic_helpers import (pid_of, reached, single_node, stop, tail,
                                               torchrun, wait, wait_until, write_config)
from tests.distributed.test_ddp import ddp
from tests.recipes import IdData, WideRecipe, args

pytestmark = pytest.mark.slow

# 103 samples, global 12 over 2 ranks x micro 3: accumulation 2; the last step (7 samples)
# splits 4 + 3, so one rank runs a weight-0 padding micro-batch.
DATA = {"n_train": 103, "n_val": 31}
TRAINER = {"epochs": 2, "train_batch_size": 12, "micro_batch_size": 3, "max_grad_norm": 0.3}
RECIPE = {"momentum": 0.9, "hidden": 32}


def test_fsdp_matches_ddp_and_one_process(tmp_path):
    ref = WideRecipe(IdData(**DATA), **RECIPE)
    with Trainer(ref, args(tmp_path / "sp", **{**TRAINER, "micro_batch_size": 12})) as t:
        t.train()
    (tmp_path / "d").mkdir()
    (tmp_path / "f").mkdir()
    ranks_ddp = ddp(tmp_path / "d", DATA, {**TRAINER, "backend": "ddp"}, RECIPE, kind="wide")
    ranks = ddp(tmp_path / "f", DATA, {**TRAINER, "backend": "fsdp"}, RECIPE, kind="wide")
    assert ranks[0]["summary"]["global_step"] == 18
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(ranks[0]["params"][key], value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ranks[0]["params"][key], ranks_ddp[0]["params"][key],
                                   rtol=1e-5, atol=1e-6)
    # Accumulation: one reduce-scatter per unit and step (units hidden and linear), not
    # one per micro-batch (2 or 3 per step here).
    assert ranks[0]["reduce_scatter_calls"] == ranks[1]["reduce_scatter_calls"] == 2 * 18
    # Ranks agree on the (gathered) parameters after every step.
    for a, b in zip(ranks[0]["trace"], ranks[1]["trace"]):
        assert torch.equal(a, b)
    # Validation gathered once: every sample of the validation set, once.
    assert ranks[0]["val"]["val"]["count"] == ranks[1]["val"]["val"]["count"] == 31
    final = load_file(str(tmp_path / "f" / "ddp" / "run" / "final" / "model.safetensors"))
    assert sorted(final) == sorted(ref.state_dict())  # plain names, full tensors
    # Each rank holds half of the parameters, gradients and optimizer state (momentum).
    for what in ("params", "grads", "optimizer"):
        per_rank = [r["held"][what] for r in ranks]
        assert sum(per_rank) == ranks_ddp[0]["held"][what], what
        assert max(per_rank) <= 0.6 * ranks_ddp[0]["held"][what], (what, per_rank)


def sp_reference(tmp_path):
    cfg = write_config(tmp_path, "ref", step_seconds=0)
    assert main(["train", str(cfg)]) == 0
    return load_file(str(tmp_path / "ref" / "run" / "final" / "model.safetensors"))


def assert_finished_like(tmp_path, name, ref):
    got = load_file(str(tmp_path / name / "run" / "final" / "model.safetensors"))
    assert got.keys() == ref.keys()
    for key, value in ref.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6)
    assert json.loads((tmp_path / name / "run" / "summary.json").read_text())["global_step"] == 24


def backend(argv, name):
    return [name if a == "ddp" else a for a in argv]


def kill_at(tmp_path, name, nproc_backend, step=7):
    """Start 2 workers under torchrun (no restarts) and kill -9 the job after ``step``."""
    cfg = write_config(tmp_path, name)
    records, log = tmp_path / name / "records", tmp_path / f"{name}.log"
    proc = torchrun(backend(single_node(2, cfg, restarts=0), nproc_backend), log)
    try:
        wait_until(lambda: reached(records, 0, "0-") >= step, [proc], 180, [log],
                   f"step {step}")
    finally:
        stop(proc)  # SIGKILL: agent and both workers
    return cfg, log


def test_fsdp_killed_then_resumed_alone(tmp_path, capfd):
    """kill -9 a 2-rank fsdp run; resume in one process (fsdp alone)."""
    ref = sp_reference(tmp_path)
    cfg, _ = kill_at(tmp_path, "alone", "fsdp")
    manifest = json.loads((tmp_path / "alone" / "run" / "checkpoints" / "step-00000006" /
                           "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert set(manifest["sharded"]["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    capfd.readouterr()
    assert main(["train", str(cfg), "--trainer.backend", "fsdp"]) == 0
    assert "world size 2 -> 1" in capfd.readouterr().err
    assert_finished_like(tmp_path, "alone", ref)


@pytest.mark.parametrize("first,then", [("ddp", "fsdp"), ("fsdp", "ddp")])
def test_checkpoint_resumes_under_the_other_backend(tmp_path, first, then):
    """kill -9 a 2-rank run, resume it on 2 ranks under the other backend."""
    ref = sp_reference(tmp_path)
    cfg, _ = kill_at(tmp_path, "switch", first)
    log = tmp_path / "switch-then.log"
    proc = torchrun(backend(single_node(2, cfg, restarts=0), then), log)
    try:
        assert wait([proc], 240, [log]) == [0], tail([log])
    finally:
        stop(proc)
    assert "resuming from" in log.read_text()
    assert_finished_like(tmp_path, "switch", ref)


def test_fsdp_worker_killed_under_max_restarts_completes(tmp_path):
    ref = sp_reference(tmp_path)
    cfg = write_config(tmp_path, "elastic")
    records, log = tmp_path / "elastic" / "records", tmp_path / "elastic.log"
    proc = torchrun(backend(single_node(2, cfg), "fsdp"), log)
    try:
        wait_until(lambda: reached(records, 1, "0-") >= 7, [proc], 180, [log], "step 7")
        os.kill(pid_of(records, 1, "0-w2"), signal.SIGKILL)
        assert wait([proc], 240, [log]) == [0], tail([log])
    finally:
        stop(proc)
    assert "restart 1 (torchrun): resuming from" in log.read_text()
    assert_finished_like(tmp_path, "elastic", ref)


def test_fsdp_float16_overflow_in_one_shard_skips_the_step_on_every_rank(tmp_path):
    """Only rank 1's shard sees the inf: both ranks must skip the step and halve the scale."""
    trainer = {"epochs": 1, "train_batch_size": 12, "micro_batch_size": 3, "max_steps": 4,
               "backend": "fsdp-amp", "amp_dtype": "float16", "max_grad_norm": 1.0}
    ranks = ddp(tmp_path, {"n_train": 96, "n_val": 0}, trainer, {"bad_step": 1},
                kind="shard_overflow")
    for r in ranks:
        assert r["scheduled"] == [3]  # 4 steps, one skipped
        assert r["backend"]["precision"]["scaler"]["scale"] == 2.0 ** 15
    for a, b in zip(ranks[0]["trace"], ranks[1]["trace"]):
        assert torch.equal(a, b)


def test_ema_under_fsdp_equals_one_process_and_resumes(tmp_path):
    """Each rank averages its own shard; the checkpoint holds the whole average, which a
    resume cuts again: the final average is the one-process one."""
    from tests.distributed.harness import errors, run_ranks
    from tests.distributed.test_ddp import single
    from tests.distributed.workers import train

    data = {"n_train": 96, "n_val": 0}
    trainer = {"train_batch_size": 16, "ema": {"decay": 0.8, "every_n_steps": 2}}
    single(tmp_path, data, {**trainer, "epochs": 2, "micro_batch_size": 16})
    want = load_file(str(tmp_path / "sp" / "final" / "ema.safetensors"))
    # One epoch (a checkpoint at its end), then the same run extended to two.
    fsdp = {**trainer, "micro_batch_size": 4, "backend": "fsdp"}
    ddp(tmp_path, data, {**fsdp, "epochs": 1})
    out = tmp_path / "ddp"
    codes = run_ranks(train, 2, out, data=data, trainer={**fsdp, "epochs": 2}, recipe=None,
                      kind="linear")
    assert codes == [0, 0], errors(out)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert ranks[0]["summary"]["global_step"] == 12
    saved = load_file(str(out / "run" / "final" / "ema.safetensors"))
    assert set(saved) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(saved[name], value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ranks[1]["ema"]["shadow"][name], value, rtol=1e-5,
                                   atol=1e-6)
