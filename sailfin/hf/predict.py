"""After training a ``sailfin.hf`` recipe: the default ``predict_step`` of each task
(``sailfin predict``) and loading an exported directory (``sailfin evaluate
--checkpoint final/hf``: a ``save_pretrained`` directory, or a PEFT adapter directory).

Rows: classification ``{"label", "score"}`` (the class name and its probability);
token classification ``{"tags"}`` (one tag per word: its first sub-word's);
seq2seq and causal LM ``{"generated"}`` (the text generated from the input, greedy or
``num_beams``, at most ``max_new_tokens``).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import torch

from ..checkpoint.errors import CheckpointError
from .errors import require

if TYPE_CHECKING:
    from .module import HFModule

INDEX = "model.safetensors.index.json"


def load_exported(module: "HFModule", path: str) -> None:
    """Load ``path`` (``final/hf`` or any ``save_pretrained`` / adapter directory) into
    ``module.model``, checked: every weight the directory holds fits, none is left out."""
    from safetensors.torch import load_file

    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        if module.peft is None:
            raise CheckpointError(f"--checkpoint {path} is a PEFT adapter directory, but the "
                                  "recipe has no peft: set module.init_args.peft as in "
                                  "training")
        peft = require("peft")
        weights = os.path.join(path, "adapter_model.safetensors")
        if not os.path.isfile(weights):
            raise CheckpointError(f"--checkpoint {path} has no adapter_model.safetensors")
        result = peft.set_peft_model_state_dict(module.model, load_file(weights))
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise CheckpointError(f"--checkpoint {path}: adapter weights that fit no "
                                  f"adapter of this model: {unexpected[:5]}")
        return
    if module.peft is not None:
        raise CheckpointError(
            f"--checkpoint {path} is a plain save_pretrained directory (peft_merge: the "
            "adapters merged in), which does not load into a recipe with peft: evaluate it "
            "with module.init_args.model_name_or_path set to it and peft removed")
    state: dict[str, torch.Tensor] = {}
    for name in _weight_files(path):
        state.update(load_file(os.path.join(path, name)))
    missing, unexpected = module.model.load_state_dict(state, strict=False)
    module.model.tie_weights()  # a tied weight is stored once, under its first name
    own = module.model.state_dict()
    loaded = {own[k].data_ptr() for k in state if k in own}
    missing = [k for k in missing if own[k].data_ptr() not in loaded]
    if missing or unexpected:
        raise CheckpointError(f"--checkpoint {path} does not fit this model: missing "
                              f"{missing[:5]}, unexpected {list(unexpected)[:5]}")


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as fh:
            return sorted(set(json.load(fh)["weight_map"].values()))
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return ["model.safetensors"]
    raise CheckpointError(f"--checkpoint {path} holds no model.safetensors (nor {INDEX}); "
                          "save it with save_pretrained(safe_serialization=True)")


def classification_rows(module: "HFModule", batch: dict, device: torch.device) -> dict:
    probs = module.forward_batch(_inputs(batch), device).logits.float().softmax(-1)
    score, label = probs.max(-1)
    return {"label": [module.label_names[i] for i in label.tolist()], "score": score}


def token_rows(module: "HFModule", batch: dict, device: torch.device) -> dict:
    pred = module.forward_batch(_inputs(batch), device).logits.argmax(-1).cpu()
    # A word's tag is on its first sub-word: where the labels are set (or, without
    # labels, every token the attention sees).
    keep = batch["labels"] != -100 if "labels" in batch else batch["attention_mask"].bool()
    names = module.label_names
    return {"tags": [[names[t] for t in p[k].tolist()] for p, k in zip(pred, keep)]}


def generated_rows(module: "HFModule", batch: dict, device: torch.device, causal: bool
                   ) -> dict:
    ids, mask = batch["input_ids"], batch["attention_mask"]
    new_tokens = getattr(module, "max_new_tokens", 32)
    if causal:  # generation continues each row from its last token: pad on the left
        ids, mask = _left_padded(ids, mask, module.tokenizer.pad_token_id or 0)
        config = module.model.config
        limit = getattr(config, "n_positions", None) or getattr(
            config, "max_position_embeddings", None)
        if limit and ids.shape[1] + new_tokens > limit:  # room for the new tokens: keep
            # the end of a longer prompt
            ids, mask = ids[:, -(limit - new_tokens):], mask[:, -(limit - new_tokens):]
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1
    out = module.model.generate(
        input_ids=ids.to(device), attention_mask=mask.to(device),
        num_beams=getattr(module, "num_beams", 1),
        max_new_tokens=new_tokens,
        pad_token_id=module.tokenizer.pad_token_id,
        synced_gpus=distributed)  # every rank runs as many forwards (fsdp gathers in each)
    if causal:
        out = out[:, ids.shape[1]:]  # the new tokens only
    return {"generated": module.tokenizer.batch_decode(out.cpu(), skip_special_tokens=True)}


def _inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k != "labels"}


def _left_padded(ids: torch.Tensor, mask: torch.Tensor, pad: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = mask.sum(1)
    width = ids.shape[1]
    new_ids = torch.full_like(ids, pad)
    new_mask = torch.zeros_like(mask)
    for row, n in enumerate(lengths.tolist()):
        keep = mask[row].bool()
        new_ids[row, width - n:] = ids[row][keep]
        new_mask[row, width - n:] = 1
    return new_ids, new_mask
