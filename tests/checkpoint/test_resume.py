"""Resume in one process: interrupted runs end bit-identical to uninterrupted ones."""

import json

import numpy as np
import pytest
import torch

from sailfin import Trainer
from sailfin.backends import Precision, SingleDevice
from sailfin.checkpoint import CheckpointError
from sailfin.checkpoint.rng import derive_rng, rng_state
from sailfin.distributed import DistEnv
from tests.checkpoint.helpers import (Counting, Crash, CrashAt, assert_same_params,
                                      metric_lines, params)
from tests.recipes import IdData, LinearRecipe, args


def recipe(cls=LinearRecipe, **kw):
    # dropout: the result depends on the restored random streams; momentum: on the optimizer
    # state; StepLR in the recipe: on the scheduler state.
    return cls(IdData(47, 9), dropout=0.3, momentum=0.9, **kw)


def run(tmp, crash_at=None, cls=LinearRecipe, **kw):
    module = recipe(cls)
    callbacks = [CrashAt(crash_at)] if crash_at else []
    trainer = Trainer(module, args(tmp, **kw), callbacks=callbacks)
    try:
        summary = trainer.train()
    except Crash:
        return module, trainer, None
    return module, trainer, summary


CKPT = {"every_n_steps": 3, "at_epoch_end": True}


def test_interrupted_runs_end_bit_identical(tmp_path, capfd):
    """Three interruptions, mid-epoch and right after an epoch end; 47 samples, G 10:
    epochs of 5 steps, the last one short."""
    ref, _, ref_summary = run(tmp_path / "ref", epochs=4, checkpoint=CKPT)
    out = tmp_path / "run"
    for crash in (4, 11, 16):      # resumes from steps 3, 10 (epoch end), 15 (epoch end)
        run(out, crash_at=crash, epochs=4, checkpoint=CKPT)
    module, trainer, summary = run(out, epochs=4, checkpoint=CKPT)
    assert_same_params(params(ref), params(module))
    assert metric_lines(out) == metric_lines(tmp_path / "ref")
    assert trainer.resumed_from.name == "step-00000015"
    for key in ("global_step", "epoch", "samples_seen", "val"):
        assert summary[key] == ref_summary[key]
    err = capfd.readouterr().err
    assert "resuming from" in err and "step 3, 3 step(s) into epoch 1" in err


def test_resume_continues_the_data_order_without_replay(tmp_path):
    ref, _, _ = run(tmp_path / "ref", epochs=2, checkpoint=CKPT)
    run(tmp_path / "run", crash_at=7, epochs=2, checkpoint=CKPT)
    module, _, _ = run(tmp_path / "run", epochs=2, checkpoint=CKPT)
    # Saved at step 6 (epoch 1, step 1): the resumed run starts at step 7's samples.
    assert module.step_ids == ref.step_ids[6:]


def test_module_state_and_counters_come_back(tmp_path):
    run(tmp_path, crash_at=5, cls=Counting, epochs=2, checkpoint=CKPT)
    module, trainer, _ = run(tmp_path, cls=Counting, epochs=2, checkpoint=CKPT)
    assert module.counter == 10  # 3 before the checkpoint, 7 after
    assert trainer.samples_seen == 94 and trainer.global_step == 10


def test_a_finished_run_resumes_to_nothing_left(tmp_path):
    first, _, summary = run(tmp_path, epochs=2, checkpoint=CKPT)
    lines = metric_lines(tmp_path)
    again, trainer, summary2 = run(tmp_path, epochs=2, checkpoint=CKPT)
    assert again.seen == [] and summary2["global_step"] == summary["global_step"]
    assert summary2["val"] == summary["val"]
    assert metric_lines(tmp_path) == lines  # no validation repeated
    assert_same_params(params(first), params(again))


def test_more_epochs_continue_exactly(tmp_path):
    """A finished 2-epoch run, re-run with epochs 3, equals a 3-epoch run."""
    ref, _, _ = run(tmp_path / "ref", epochs=3, checkpoint=CKPT)
    run(tmp_path / "run", epochs=2, checkpoint=CKPT)
    module, _, _ = run(tmp_path / "run", epochs=3, checkpoint=CKPT)
    assert_same_params(params(ref), params(module))
    assert metric_lines(tmp_path / "run") == metric_lines(tmp_path / "ref")


def test_max_steps_stop_then_longer_run(tmp_path):
    ref, _, _ = run(tmp_path / "ref", epochs=3, checkpoint=CKPT)
    run(tmp_path / "run", epochs=3, max_steps=7, checkpoint=CKPT)  # saved at its end, step 7
    module, trainer, _ = run(tmp_path / "run", epochs=3, checkpoint=CKPT)
    assert trainer.resumed_from.name == "step-00000007"
    assert_same_params(params(ref), params(module))


def test_resume_from_an_explicit_path(tmp_path):
    ref, _, _ = run(tmp_path / "ref", epochs=2, checkpoint=CKPT)
    run(tmp_path / "a", crash_at=8, epochs=2, checkpoint=CKPT)
    path = tmp_path / "a" / "checkpoints" / "step-00000003"
    module, trainer, _ = run(tmp_path / "b", epochs=2, resume=str(path), checkpoint=CKPT)
    assert trainer.resumed_from.manifest["step"] == 3
    assert_same_params(params(ref), params(module))
    # A directory of checkpoints resumes from its newest.
    _, trainer, _ = run(tmp_path / "c", epochs=2, resume=str(tmp_path / "a" / "checkpoints"),
                        checkpoint=CKPT)
    assert trainer.resumed_from.manifest["step"] == 6


def test_missing_resume_path_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="trainer.resume: .*does not exist"):
        run(tmp_path, resume=str(tmp_path / "nothing"))


def test_never_refuses_to_mix_with_existing_checkpoints(tmp_path):
    run(tmp_path, epochs=1)
    with pytest.raises(CheckpointError, match="resume is never, but .* holds checkpoints"):
        run(tmp_path, epochs=1, resume="never")
    module, trainer, _ = run(tmp_path / "fresh", epochs=1, resume="never")
    assert trainer.resumed_from is None and len(module.seen) == 5


def test_another_global_batch_mid_epoch_is_refused(tmp_path):
    run(tmp_path, crash_at=4, epochs=2, checkpoint=CKPT)
    with pytest.raises(CheckpointError, match=r"3 step\(s\) into epoch 1 with "
                                              "trainer.train_batch_size = 10; this run has 5"):
        run(tmp_path, epochs=2, train_batch_size=5, micro_batch_size=5, checkpoint=CKPT,
            resume_config="accept")  # past the config check: the data position refuses it


def test_another_model_is_refused_with_advice(tmp_path):
    run(tmp_path, epochs=1)

    class Wider(LinearRecipe):
        def __init__(self, data, **kw):
            super().__init__(data, **kw)
            self.extra = torch.nn.Linear(4, 4)

    with pytest.raises(CheckpointError, match="(?s)does not fit this run: .*extra.weight.*"
                                              "another recipe or configuration"):
        Trainer(Wider(IdData(47, 9)), args(tmp_path)).train()


def test_a_rank_without_saved_random_state_derives_one(tmp_path, capfd):
    """Saved on one rank, resumed as rank 1 of 2 (an elastic resize)."""
    run(tmp_path, crash_at=4, epochs=2, checkpoint=CKPT)
    module = recipe()
    dist = DistEnv(rank=1, world_size=2)
    # The single-device strategy as rank 1 (no process group needed to load).
    backend = SingleDevice(Precision(), torch.device("cpu"), dist)
    trainer = Trainer(module, args(tmp_path, epochs=2, micro_batch_size=5, checkpoint=CKPT),
                      dist=dist, backend=backend)
    trainer.setup()
    state = rng_state()
    derive_rng(0, 1, 3)
    assert torch.equal(state["torch"], torch.get_rng_state())
    assert np.array_equal(state["numpy"]["key"].numpy(), rng_state()["numpy"]["key"].numpy())
    assert "rank 1 has no saved random state (the checkpoint ran on 1 ranks)" in \
        capfd.readouterr().err
    assert trainer.global_step == 3 and trainer.plan.accumulation == 1


def test_manifest_describes_the_run(tmp_path):
    run(tmp_path, crash_at=4, epochs=2, checkpoint=CKPT)
    manifest = json.loads((tmp_path / "checkpoints" / "step-00000003" / "manifest.json")
                          .read_text())
    assert manifest["step"] == 3 and manifest["epoch"] == 0 and manifest["step_in_epoch"] == 3
    assert manifest["samples_seen"] == 30 and manifest["world_size"] == 1
    assert manifest["data"] == {"seed": 0, "epoch": 0, "step_in_epoch": 3, "global_batch": 10,
                                "num_samples": 47, "shuffle": True}
    assert manifest["sailfin_version"] and manifest["config"]["train_batch_size"] == 10
    assert "files" not in manifest  # the small state is in the shards:
    assert sorted(manifest["sharded"]["entries"]) == ["rng/rank00000", "trainer"]
    assert manifest["sharded"]["keys"] == ["module", "optimizers"]  # DCP, on every backend
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(tmp_path / "checkpoints" / "step-00000003" / "shards"))
    names = set(reader.read_metadata().state_dict_metadata)
    assert {"module.linear.weight", "module.linear.bias"} <= names


def test_cli_reports_checkpoint_errors_without_a_traceback(tmp_path, capsys):
    from sailfin.cli import main

    config = tmp_path / "run.yaml"
    config.write_text(f"""
data: {{class_path: tests.recipes.IdData, init_args: {{n_train: 20, n_val: 0}}}}
module: {{class_path: tests.recipes.LinearRecipe}}
trainer: {{train_batch_size: 10, writers: [jsonl], output_dir: {tmp_path / "out"}}}
""")
    assert main(["train", str(config)]) == 0
    assert main(["train", str(config), "--trainer.resume", "never"]) == 2
    err = capsys.readouterr().err
    assert "sailfin: checkpoint error: trainer.resume is never, but" in err
