"""The model zoo: models written the way their users write them start from the same weights
under sp, ddp and fsdp (2 gloo processes, default settings), and fsdp trains as ddp.

Each model is built from a YAML config as ``sailfin train`` builds it (``RunConfig.build``
with the cli's builder: under fsdp rank 0 builds it, the other rank on the meta device):
a nanoGPT-style GPT (tests/distributed/zoo_models.py), Hugging Face BERT, GPT-2 and T5
from ``config:`` through ``sailfin.hf``, a BERT from a ``save_pretrained`` directory, and a
vision model (transformers' ConvNeXt from a config: timm needs torchvision, which does not
import beside this torch CPU wheel).

Every recipe's first optimizer step has learning rate 0, so the weights after step 1 are
the starting weights: they must be bit-identical across the three backends (and, for the
pretrained BERT, equal the saved file). Four more steps of fsdp then match ddp within
rtol 1e-4, atol 1e-5 (the order of the gradient reductions differs: reduce-scatter
against all-reduce).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import yaml

from sailfin import Callback, Trainer, load_config
from sailfin.cli import _module_builder
from tests.distributed.harness import errors, free_port, run_ranks

transformers = pytest.importorskip("transformers")

STEPS = 5
TRAINER = {"epochs": 4, "max_steps": STEPS, "train_batch_size": 8, "micro_batch_size": 4,
           "seed": 0, "writers": [], "val_every_n_epochs": 0, "sanity_val_batches": 0,
           "progress": "none", "checkpoint": {"at_epoch_end": False}}
HF_DATA = {"per_package": 12, "vocab_size": 400, "max_length": 32}
NO_DROPOUT = {"bert": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
              "gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
              "t5": {"dropout_rate": 0.0}}
HF_CONFIGS = {
    "bert": {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 2, "intermediate_size": 64,
             "max_position_embeddings": 64, **NO_DROPOUT["bert"]},
    "gpt2": {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64,
             **NO_DROPOUT["gpt2"]},
    "t5": {"model_type": "t5", "d_model": 32, "d_kv": 16, "d_ff": 64, "num_layers": 2,
           "num_decoder_layers": 2, "num_heads": 2, "relative_attention_num_buckets": 8,
           **NO_DROPOUT["t5"]},
}
HF = {"bert": ("classification", "SequenceClassification"),
      "gpt2": ("causal_lm", "CausalLM"), "t5": ("seq2seq", "Seq2SeqLM")}


def hf_spec(task: str, cls: str, data_dir, module_args: dict) -> dict:
    extra = {"max_new_tokens": 4, "generate": False} if task == "seq2seq" else {}
    # warmup_steps 1: the linear schedule's first step has learning rate 0.
    return {"data": {"class_path": "sailfin.hf.examples_data.StdlibTextData",
                     "init_args": {"task": task, "out_dir": str(data_dir), **HF_DATA}},
            "module": {"class_path": f"sailfin.hf.{cls}",
                       "init_args": {"lr": 1e-3, "warmup_steps": 1, "save_hf": False,
                                     **extra, **module_args}}}


def spec(name: str, data_dir) -> dict:
    if name == "gpt":
        return {"data": {"class_path": "tests.distributed.zoo_models.Tokens"},
                "module": {"class_path": "tests.distributed.zoo_models.GPT"}}
    if name == "convnext":
        return {"data": {"class_path": "tests.distributed.zoo_models.Images"},
                "module": {"class_path": "tests.distributed.zoo_models.ConvNext"}}
    if name == "bert-pretrained":
        return hf_spec("classification", "SequenceClassification", data_dir,
                       {"model_name_or_path": str(data_dir / "bert-pretrained")})
    task, cls = HF[name]
    return hf_spec(task, cls, data_dir, {"config": HF_CONFIGS[name]})


class Record(Callback):
    """The full weights after step 1 (the start: learning rate 0) and after the last step.
    A collective under fsdp: every rank gathers, rank 0 keeps them."""

    def __init__(self) -> None:
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.snapshots: list = []  # with memory snapshots: (count, this rank's share in bytes)

    def on_step_end(self, trainer) -> None:
        from sailfin.trainer.checkpointing.memory_snapshots import snapshots_of

        snapshots = snapshots_of(trainer)
        if snapshots is not None and trainer.global_step == STEPS:
            snapshots.store.wait()
            own = snapshots.store.own_dir()
            share = max(os.path.getsize(os.path.join(own, f)) for f in os.listdir(own)
                        if f.endswith(".bin"))
            self.snapshots = [len(snapshots.stall_seconds), share]
        if trainer.global_step in (1, STEPS):
            state = trainer.backend.final_state_dict(trainer.module)
            self.weights[trainer.global_step] = {k: v.detach().clone().cpu()
                                                 for k, v in state.items()}


def train(config_path: str, backend: str, out, dist_args=None, extra=(), record=None) -> dict:
    overrides = ["--trainer.backend", backend, "--trainer.output_dir", str(out), *extra]
    cfg = load_config(config_path, overrides)
    trainer_args = cfg.trainer
    if dist_args is not None:
        trainer_args = dataclasses.replace(trainer_args, distributed=dist_args)
    module = cfg.build(_module_builder(trainer_args))
    record = record or Record()
    with Trainer(module, trainer_args, callbacks=[record]) as trainer:
        trainer.train()
    return record.weights


def zoo_rank(rank, world, dist_args, out, config_path, second_port):
    """ddp, then fsdp, in the same two processes (each with a process group of its own)."""
    for backend, port in (("ddp", dist_args.master_port), ("fsdp", second_port)):
        weights = train(config_path, backend, out / backend,
                        dataclasses.replace(dist_args, master_port=port))
        if rank == 0:
            torch.save(weights, out / f"{backend}.pt")


def observed_rank(rank, world, dist_args, out, config_path, second_port):
    """ddp without, then with, a memory snapshot every step (each rank copying its share of
    the node's one copy), in the same two processes."""
    for name, port in (("off", dist_args.master_port), ("on", second_port)):
        extra = (["--trainer.checkpoint.memory.every_n_steps", "1",
                  "--trainer.checkpoint.memory.dir", str(out / "shm")] if name == "on" else [])
        record = Record()
        weights = train(config_path, "ddp", out / name,
                        dataclasses.replace(dist_args, master_port=port), extra, record)
        torch.save({"weights": weights, "snapshots": record.snapshots},
                   out / f"{name}-rank{rank}.pt")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """The example rows and tokenizer for each HF task, and a pretrained BERT."""
    from sailfin.hf import SequenceClassification
    from sailfin.hf.examples_data import StdlibTextData

    path = tmp_path_factory.mktemp("zoo-data")
    for task in ("classification", "causal_lm", "seq2seq"):
        StdlibTextData(task, str(path), **HF_DATA)
    torch.manual_seed(123)  # other weights than a fresh build with the run's seed
    bert = SequenceClassification(StdlibTextData("classification", str(path), **HF_DATA),
                                  config=HF_CONFIGS["bert"])
    bert.model.save_pretrained(str(path / "bert-pretrained"))
    return path


MODELS = ["gpt", "bert", "gpt2", "t5", "bert-pretrained", "convnext"]


@pytest.mark.slow  # 2 processes x 2 backends per model: about half a minute each
@pytest.mark.parametrize("name", MODELS)
def test_every_backend_starts_from_the_same_weights_and_fsdp_trains_as_ddp(
        tmp_path, data_dir, name):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({**spec(name, data_dir), "trainer": TRAINER}))
    sp = train(str(config), "sp", tmp_path / "sp")
    assert run_ranks(zoo_rank, 2, tmp_path, timeout=300, config_path=str(config),
                     second_port=free_port()) == [0, 0], errors(tmp_path)
    runs = {b: torch.load(tmp_path / f"{b}.pt", weights_only=True) for b in ("ddp", "fsdp")}
    start = sp[1]
    if name == "bert-pretrained":  # the saved weights, not a fresh initialisation
        from safetensors.torch import load_file

        saved = load_file(str(data_dir / "bert-pretrained" / "model.safetensors"))
        for key, value in saved.items():
            assert torch.equal(start[f"model.{key}"], value), key
    for backend, got in runs.items():
        assert got[1].keys() == start.keys(), backend
        for key, value in start.items():
            assert torch.equal(got[1][key], value), (backend, key)
    moved = [k for k, v in runs["ddp"][STEPS].items() if not torch.equal(v, start[k])]
    assert moved, "training changed nothing: the comparison below would prove nothing"
    for key, value in runs["ddp"][STEPS].items():
        torch.testing.assert_close(runs["fsdp"][STEPS][key], value, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, key=key: f"{name} {key}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "gpt2"])
def test_memory_snapshots_every_step_leave_ddp_bit_identical(tmp_path, data_dir, name):
    """Observing never changes a run, on models sailfin did not write: 2-process ddp with
    a memory snapshot every step, both ranks copying a share, against the same run
    without, bit for bit."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({**spec(name, data_dir), "trainer": TRAINER}))
    assert run_ranks(observed_rank, 2, tmp_path, timeout=300, config_path=str(config),
                     second_port=free_port()) == [0, 0], errors(tmp_path)
    off, on = (torch.load(tmp_path / f"{arm}-rank0.pt", weights_only=True)
               for arm in ("off", "on"))
    for rank in (0, 1):  # every step snapshotted; each rank's set holds a share
        count, share = torch.load(tmp_path / f"on-rank{rank}.pt",
                                  weights_only=True)["snapshots"]
        # (Record's step end runs before that step's snapshot: STEPS - 1 taken by then.)
        assert count >= STEPS - 1 and share > 0, (rank, count, share)
    moved = [k for k, v in off["weights"][STEPS].items()
             if not torch.equal(v, off["weights"][1][k])]
    assert moved, "training changed nothing: the comparison below would prove nothing"
    for key, value in off["weights"][STEPS].items():
        assert torch.equal(on["weights"][STEPS][key], value), (name, key)
