"""Parameter-efficient fine-tuning (LoRA and the other PEFT methods) from a config's fields:
``peft`` does the work; the recipe's checkpoints then hold the trainable parameters and a
fingerprint of the frozen base.

Example (a recipe of one's own)::

    self.model = apply_peft(self, AutoModelForCausalLM.from_pretrained(path),
                            {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]})
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional, Union

import torch

from ..config.errors import suggest, unknown_key
from .errors import HFConfigError, require

# sailfin.hf's task -> peft's TaskType (which also picks the head kept trainable:
# a classifier's ``modules_to_save``).
TASK_TYPES = {"classification": "SEQ_CLS", "token_classification": "TOKEN_CLS",
              "causal_lm": "CAUSAL_LM", "seq2seq": "SEQ_2_SEQ_LM"}
KEY = "module.init_args.peft"


def peft_config(spec: dict[str, Any], task_type: Optional[str] = None, key: str = KEY) -> Any:
    """A ``peft`` config object from a mapping of its fields (``r``, ``lora_alpha``,
    ``target_modules``, ...). ``peft_type`` defaults to ``LORA``; ``task_type`` to the
    argument. An unknown field or type is a :class:`HFConfigError` naming ``key``."""
    peft = require("peft")
    if not isinstance(spec, dict):
        raise HFConfigError(f"{key} must be a mapping of a PEFT config's fields (r, "
                            f"lora_alpha, target_modules, ...), got {type(spec).__name__}")
    spec = dict(spec)
    kind = str(spec.pop("peft_type", "LORA")).upper()
    types = [t.value for t in peft.PeftType if t in peft.PEFT_TYPE_TO_CONFIG_MAPPING]
    if kind not in types:
        raise HFConfigError(f"{key}.peft_type is '{kind}'{suggest(kind, types)}; use one of "
                            f"{', '.join(types)}")
    cls = peft.PEFT_TYPE_TO_CONFIG_MAPPING[kind]
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    for name in spec:
        if name not in fields:
            exc = unknown_key(name, fields - {"peft_type"}, f"{key}.")
            raise HFConfigError(f"{exc} ({cls.__name__})") from None
    if task_type is not None:
        spec.setdefault("task_type", task_type)
    try:
        return cls(**spec)
    except (TypeError, ValueError) as exc:
        raise HFConfigError(f"{key}: {cls.__name__} refuses these fields: "
                            f"{str(exc).splitlines()[0]}") from None


def apply_peft(recipe: torch.nn.Module, model: torch.nn.Module,
               peft: Union[dict[str, Any], Any], task_type: Optional[str] = None) -> Any:
    """``model`` wrapped by ``peft.get_peft_model`` with ``peft`` (a mapping of a PEFT
    config's fields, or a config object): only the adapters (and ``modules_to_save``)
    keep ``requires_grad``. ``recipe`` is marked ``checkpoint_frozen_params = False``
    so its checkpoints hold the trainable state only."""
    lib = require("peft")
    config = peft if isinstance(peft, lib.PeftConfig) else peft_config(peft, task_type)
    try:
        # A copy: peft adds the task's head (classifier, score) to the config it is given,
        # and the recipe's config is used again (final/hf, sailfin export), which added
        # them twice to modules_to_save.
        wrapped = lib.get_peft_model(model, copy.deepcopy(config))
    except ValueError as exc:  # e.g. target_modules naming no module of this model
        raise HFConfigError(f"{KEY}: {str(exc).splitlines()[0]}") from None
    recipe.checkpoint_frozen_params = False
    return wrapped
