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
