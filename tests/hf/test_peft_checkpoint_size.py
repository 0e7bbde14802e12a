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
    # hold with the base in it. So: not one frozen parameter is in the checkpoint's shards,
    # every trainable one is.
    import torch.distributed.checkpoint as dcp

    (ckpt,) = [p for p in (tmp_path / "lora" / "checkpoints").iterdir()
               if p.name.startswith("step-")]
    saved = {k[len("module."):] for k in dcp.FileSystemReader(str(ckpt / "shards"))
             .read_metadata().state_dict_metadata if k.startswith("module.")}
    params = dict(module.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert trainable and trainable <= saved
    assert not saved & {n for n, p in params.items() if not p.requires_grad}
