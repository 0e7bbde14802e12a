"""With peft, a checkpoint holds the trainable state (adapters, head, their optimizer
state) and a fingerprint of the frozen base, not the base itself: at most half the bytes
of the same model's full fine-tune (module.checkpoint_frozen_params = False)."""

import pytest

from tests.hf.helpers import train

pytest.importorskip("transformers")
pytest.importorskip("peft")


def checkpoint_bytes(out):
    (ckpt,) = [p for p in (out / "checkpoints").iterdir() if p.name.startswith("step-")]
    return sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())


def test_a_lora_checkpoint_is_at_most_half_the_bytes_of_a_full_fine_tune(data_dir, tmp_path):
    run = dict(max_steps=2, checkpoint={"every_n_steps": 2, "at_epoch_end": False})
    train("causal_lm", data_dir, tmp_path / "full", **run)
    module, _, _ = train("causal_lm", data_dir, tmp_path / "lora",
                         module_kw={"peft": {"r": 4, "lora_alpha": 8}}, **run)
    assert module.checkpoint_frozen_params is False
    full, lora = checkpoint_bytes(tmp_path / "full"), checkpoint_bytes(tmp_path / "lora")
    assert lora <= full / 2, (lora, full)
    # The full fine-tune's checkpoint is mostly Adam's two moments: the half above would
    # hold with the base in it. The base's own bytes must not be in it either.
    weights = (tmp_path / "lora" / "final" / "model.safetensors").stat().st_size
    assert lora <= weights / 2, (lora, weights)
