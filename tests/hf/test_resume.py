"""Interrupted HF runs resume exactly: the same weights and the same logged metrics."""

import pytest

from tests.checkpoint.helpers import Crash, CrashAt, assert_same_params, metric_lines, params
from tests.hf.helpers import train

pytest.importorskip("transformers")

# 7 steps of 8 samples, a checkpoint every 3, validation every 3.
RUN = dict(max_steps=7, checkpoint={"every_n_steps": 3}, val_every_n_steps=3)


@pytest.mark.parametrize("task", ["classification", "causal_lm"])
def test_a_crash_and_a_resume_end_bit_identical(task, data_dir, tmp_path):
    # Dropout is on (HF's default 0.1): the result depends on the restored random streams.
    ref, _, ref_summary = train(task, data_dir, tmp_path / "ref", **RUN)
    out = tmp_path / "run"
    with pytest.raises(Crash):
        train(task, data_dir, out, callbacks=[CrashAt(5)], **RUN)
    module, trainer, summary = train(task, data_dir, out, **RUN)
    assert trainer.resumed_from.name == "step-00000003"
    assert_same_params(params(ref), params(module))
    assert metric_lines(out) == metric_lines(tmp_path / "ref")
    assert summary["val"] == ref_summary["val"]
    assert (out / "final" / "hf" / "model.safetensors").exists()


def test_a_crash_resumed_from_memory_snapshots_ends_as_a_run_without_them(data_dir, tmp_path,
                                                                            capfd):
    """A GPT-2 (dropout on) with a memory snapshot every step, killed at step 6 and resumed
    from its snapshots, ends with the weights of the same run without snapshots: the
    copies made while training went on, and the files the writer process wrote, hold each
    step's state exactly, snapshot after snapshot."""
    plain = dict(max_steps=7, checkpoint={"at_epoch_end": False})
    ref, _, _ = train("causal_lm", data_dir, tmp_path / "ref", **plain)
    snapshots = dict(max_steps=7, checkpoint={
        "at_epoch_end": False, "memory": {"every_n_steps": 1, "dir": str(tmp_path / "shm")}})
    out = tmp_path / "run"
    with pytest.raises(Crash):  # step 6 waited for step 5's write: it is complete
        train("causal_lm", data_dir, out, callbacks=[CrashAt(6)], **snapshots)
    capfd.readouterr()
    module, trainer, _ = train("causal_lm", data_dir, out, **snapshots)
    assert "resuming from memory, step 5" in capfd.readouterr().err
    assert_same_params(params(ref), params(module))
    assert not (tmp_path / "shm").exists()  # removed at the normal end
