"""fsdp-dp on 2 CPU processes (gloo): DP-SGD on an FSDP2-sharded model with Opacus's
ghost_fsdp clipping; the same epsilon, batches and weights as ddp-dp; kill -9 and resume
bit-identical; resume of a ddp-dp checkpoint under fsdp-dp; what Opacus cannot run is
refused before the first step."""

from __future__ import annotations

import json

import pytest
import torch

from sailfin import Trainer
from sailfin.config.errors import ConfigError
from tests.checkpoint.helpers import final_weights, metric_lines
from tests.distributed.elastic_helpers import stop, tail, torchrun, wait, wait_until
from tests.distributed.harness import errors, run_ranks
from tests.dp.recipes import PerSampleRecipe, dp_args, train_dp_rank
from tests.recipes import IdData

pytest.importorskip("opacus")
from opacus.accountants import RDPAccountant  # noqa: E402

GHOST = {"clipping": "ghost"}

CONFIG = """
data: {class_path: tests.recipes.IdData, init_args: {n_train: 47, n_val: 9}}
module:
  class_path: tests.dp.recipes.SlowWidePerSample
  init_args: {step_seconds: STEP}
trainer:
  backend: fsdp-dp
  epochs: 3
  train_batch_size: 10
  micro_batch_size: 5
  seed: 3
  log_every_n_steps: 1
  writers: [jsonl]
  progress: none
  output_dir: OUT
  checkpoint: {every_n_steps: 3}
  dp: {noise_multiplier: 1.1, max_grad_norm: 1.0, clipping: ghost}
"""


def two_ranks(out, backend, **kw):
    out.mkdir()
    codes = run_ranks(train_dp_rank, 2, out, timeout=240, backend=backend, **kw)
    assert codes == [0, 0], errors(out)
    seen = [json.loads((out / f"seen-{r}.json").read_text()) for r in range(2)]
    return (torch.load(out / "weights.pt"), json.loads((out / "privacy.json").read_text()),
            sorted(seen[0] + seen[1]))


@pytest.mark.slow
def test_fsdp_dp_equals_ddp_dp_and_reports_the_accountants_epsilon(tmp_path):
    fsdp = two_ranks(tmp_path / "fsdp", "fsdp-dp", per_sample=True, dp=GHOST)
    ddp = two_ranks(tmp_path / "ddp", "ddp-dp", per_sample=True, dp=GHOST)
    reference = RDPAccountant()
    reference.history = [(1.1, 10 / 47, 10)]
    assert fsdp[1]["accounted_steps"] == 10
    assert abs(fsdp[1]["epsilon"] - reference.get_epsilon(delta=1 / 47)) < 1e-12
    assert fsdp[1] == ddp[1]
    assert fsdp[2] == ddp[2]  # the same Poisson batches, split the same way
    # Every rank adds the same noise to its rows (one seeded generator): the weights are
    # ddp-dp's, noise included, up to the order of float sums.
    for key, value in ddp[0].items():
        torch.testing.assert_close(fsdp[0][key], value, rtol=0, atol=1e-5)


def config(tmp_path, name, step, backend="fsdp-dp"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(CONFIG.replace("OUT", str(tmp_path / name)).replace("STEP", str(step))
                    .replace("backend: fsdp-dp", f"backend: {backend}"))
    return path


def launch(cfg, log, backend=None):
    extra = ["--trainer.backend", backend] if backend else []
    return torchrun(["--nnodes=1", "--nproc-per-node=2", "--max-restarts=0",
                     "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
                     "--monitor-interval=0.1", "-m", "sailfin", "train", str(cfg), *extra], log)


def latest_step(out):
    try:
        return int((out / "checkpoints" / "latest").read_text().split("-")[1])
    except (FileNotFoundError, IndexError, ValueError):
        return -1


def finish(cfg, log, backend=None):
    proc = launch(cfg, log, backend)
    try:
        assert wait([proc], 240, [log]) == [0], tail([log])
    finally:
        stop(proc)


def kill_after(cfg, out, log, step):
    proc = launch(cfg, log)
    try:
        wait_until(lambda: latest_step(out) >= step, [proc], 240, [log], f"step {step}")
    finally:
        stop(proc)  # SIGKILL: the agent and both workers
    assert not (out / "summary.json").exists()


def untimed(events):
    """Metric events without the per-rank step times (the clock, not the training)."""
    return [{k: v for k, v in e.items() if not k.startswith("step_time") and
             k != "slowest_rank"} for e in events]


def summary(out):
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_fsdp_dp_killed_then_resumed_is_bit_identical_and_resumes_a_ddp_dp_run(tmp_path):
    ref = tmp_path / "ref"
    finish(config(tmp_path, "ref", 0), tmp_path / "ref.log")
    # kill -9 the 2-rank job past its step-6 checkpoint, resume it on 2 ranks.
    out, cfg = tmp_path / "run", config(tmp_path, "run", 0.05)
    kill_after(cfg, out, tmp_path / "run.log", 6)
    finish(cfg, tmp_path / "run.log")
    a, b = final_weights(out), final_weights(ref)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in b)
    assert summary(out)["privacy"] == summary(ref)["privacy"]
    assert untimed(metric_lines(out)) == untimed(metric_lines(ref))
    # A ddp-dp job killed the same way resumes under fsdp-dp: the same run.
    out, cfg = tmp_path / "switch", config(tmp_path, "switch", 0.05, backend="ddp-dp")
    kill_after(cfg, out, tmp_path / "switch.log", 6)
    finish(cfg, tmp_path / "switch.log", backend="fsdp-dp")
    assert "resuming from" in (tmp_path / "switch.log").read_text()
    a = final_weights(out)
    for key, value in b.items():
        torch.testing.assert_close(a[key], value, rtol=0, atol=1e-5)
    assert summary(out)["privacy"] == summary(ref)["privacy"]


def test_fsdp_dp_without_ghost_clipping_is_refused_before_anything_runs(tmp_path):
    module = PerSampleRecipe(IdData(47, 0))
    with pytest.raises(ConfigError) as info:
        Trainer(module, dp_args(tmp_path, backend="fsdp-dp", dp={"clipping": "flat"}))
    line = str(info.value)
    assert "ghost clipping only" in line and "trainer.dp.clipping: ghost" in line
    assert "\n" not in line and module.seen == []


def test_fsdp_dp_in_one_process_equals_sp_dp(tmp_path):
    runs = {}
    for backend in ("sp-dp", "fsdp-dp"):
        module = PerSampleRecipe(IdData(47, 0))
        with Trainer(module, dp_args(tmp_path / backend, backend=backend, dp=GHOST)) as t:
            privacy = t.train()["privacy"]
            runs[backend] = (t.backend.final_state_dict(module), privacy)
    assert runs["sp-dp"][1] == runs["fsdp-dp"][1]
    for key, value in runs["sp-dp"][0].items():
        assert runs["fsdp-dp"][0][key].equal(value), key


@pytest.mark.slow
def test_a_parameter_opacus_fsdp_cannot_step_is_refused_naming_it(tmp_path):
    codes = run_ranks(train_dp_rank, 2, tmp_path, timeout=240, backend="fsdp-dp",
                      dp=GHOST)  # LinearRecipe: linear.weight is [1, 4]
    assert codes != [0, 0]
    text = errors(tmp_path)[0].splitlines()[0]
    assert "ConfigError: trainer.backend fsdp-dp" in text
    assert "linear.weight [1, 4]" in text and "train with ddp-dp" in text
    assert not (tmp_path / "seen-0.json").exists()
