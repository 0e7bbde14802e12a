"""LoRA on 2 gloo processes: fsdp (frozen base and adapters in the same units) ends
within 1e-4 of ddp, and fsdp-dp with LoRA runs or is refused in one line."""

import pytest
from safetensors.torch import load_file

from tests.distributed.harness import errors, run_ranks
from tests.hf.fsdp_worker import lora_rank

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytestmark = pytest.mark.slow  # about a minute each on 2 busy cores

TRAINER = dict(max_steps=3, train_batch_size=8, micro_batch_size=2)


def run(backend, data_dir, out, **trainer):
    out.mkdir()
    codes = run_ranks(lora_rank, 2, out, timeout=240, task="causal_lm", data_dir=data_dir,
                      backend=backend, trainer={**TRAINER, **trainer})
    assert codes == [0, 0], errors(out)
    return load_file(str(out / "run" / "final" / "model.safetensors"))


def test_fsdp_with_lora_ends_within_1e_4_of_ddp_with_lora(data_dir, tmp_path):
    ddp = run("ddp", data_dir, tmp_path / "ddp")
    fsdp = run("fsdp", data_dir, tmp_path / "fsdp")
    assert ddp.keys() == fsdp.keys()
    lora = [k for k in ddp if "lora_" in k]
    assert lora
    for key, value in ddp.items():
        assert (fsdp[key] - value).abs().max().item() <= 1e-4, key
    # The adapters trained (lora_B starts at zero).
    assert any(ddp[k].abs().max() > 0 for k in lora if "lora_B" in k)
