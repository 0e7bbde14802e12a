"""LoRA on 2 gloo processes: fsdp (frozen base and adapters in the same units) ends
within 1e-4 of ddp; fsdp-dp (Opacus's FSDP ghost clipping) and ddp-dp with LoRA train
the adapters and leave the frozen base as built."""

import pytest
import torch
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


def test_fsdp_dp_with_lora_noises_only_the_adapters(data_dir, tmp_path):
    """DP-LoRA on a sharded base: Opacus's FSDP ghost clipping on the trainable
    parameters (train_step returns each sample's loss); the frozen base stays as built."""
    final = run("fsdp-dp", data_dir, tmp_path / "dp",
                dp={"noise_multiplier": 1.0, "delta": 1e-3, "clipping": "ghost"})
    _only_the_adapters_moved(final, data_dir)


def test_ddp_dp_with_lora_noises_only_the_adapters(data_dir, tmp_path):
    """DP-LoRA on 2 data-parallel processes: per-sample gradients (Opacus's hooks) and
    noise for the adapters alone; the frozen base stays as built."""
    final = run("ddp-dp", data_dir, tmp_path / "dp", dp={"noise_multiplier": 1.0, "delta": 1e-3})
    _only_the_adapters_moved(final, data_dir)


def _only_the_adapters_moved(final, data_dir):
    from sailfin import seed_everything
    from tests.hf.helpers import NO_DROPOUT, module

    seed_everything(0)  # as each rank built it
    built = module("causal_lm", data_dir, config_kw=NO_DROPOUT["causal_lm"],
                   peft={"r": 4, "lora_alpha": 8, "lora_dropout": 0.0})
    start = built.state_dict()
    lora = [k for k in final if "lora_B" in k]
    assert lora and all(final[k].abs().max() > 0 for k in lora)  # noised and stepped
    for key, value in final.items():
        if "lora_" not in key:  # the frozen base: the weights every run starts from
            assert (value == start[key]).all(), key


def test_a_lora_checkpoint_of_fsdp_resumes_on_one_process_with_its_base_checked(data_dir,
                                                                               tmp_path):
    """The fingerprint of the frozen base is a checksum of each whole tensor (gathered under
    fsdp): one process resumes a 2-process fsdp checkpoint onto the same base, and refuses
    the base with two rows of wte swapped."""
    from sailfin import Trainer, seed_everything
    from sailfin.checkpoint import CheckpointError
    from tests.hf.helpers import NO_DROPOUT, args, module

    run("fsdp", data_dir, tmp_path / "fsdp", max_steps=2, checkpoint={"every_n_steps": 2})
    out = tmp_path / "fsdp" / "run"

    def built():
        seed_everything(0)
        return module("causal_lm", data_dir, config_kw=NO_DROPOUT["causal_lm"],
                      peft={"r": 4, "lora_alpha": 8, "lora_dropout": 0.0})

    swapped = built()
    (wte,) = [p for n, p in swapped.named_parameters() if n.endswith("transformer.wte.weight")]
    with torch.no_grad():
        wte[[0, 1]] = wte[[1, 0]].clone()
    trainer = Trainer(swapped, args(out, **{**TRAINER, "max_steps": 3}))
    with pytest.raises(CheckpointError, match="another frozen base: frozen parameter "
                                              ".*transformer.wte.weight differs"):
        trainer.setup()
    trainer.close()
    trainer = Trainer(built(), args(out, **{**TRAINER, "max_steps": 3}))
    trainer.train()
    assert trainer.resumed_from.name == "step-00000002"
