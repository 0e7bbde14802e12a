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
import typing
from typing import Any, Optional, Union

import torch

from ..config.coerce import coerce
from ..config.errors import ConfigError, short_repr, suggest, unknown_key
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
    hints = _field_types(cls)
    for name, value in spec.items():
        spec[name] = _checked(value, hints.get(name), name, f"{key}.{name}")
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
    check_rank(config, model)  # before peft allocates r x (in + out) per adapted layer
    try:
        # A copy: peft adds the task's head (classifier, score) to the config it is given,
        # and the recipe's config is used again (final/hf, sailfin export), which added
        # them twice to modules_to_save.
        wrapped = lib.get_peft_model(model, copy.deepcopy(config))
    except ValueError as exc:  # e.g. target_modules naming no module of this model
        raise HFConfigError(f"{KEY}: {str(exc).splitlines()[0]}") from None
    recipe.checkpoint_frozen_params = False
    return wrapped


# Fields that are ranks: a positive count, at most the rank a weight matrix can have.
RANKS = ("r", "init_r", "target_r")


def _field_types(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # annotations that do not evaluate here: the values go as given
        return {}


def _checked(value: Any, tp: Any, name: str, key: str) -> Any:
    """``value`` for a field annotated ``tp``: a plain bool, int or float field gets its
    type and a finite value (``r: 2.5``, ``r: eight``, ``lora_alpha: .nan`` are one line);
    a rank is 1 or more. Other fields go to peft as given."""
    if tp not in (bool, int, float):
        return value
    try:
        value = coerce(value, tp, key, finite=True)
    except ConfigError as exc:
        raise HFConfigError(str(exc)) from None
    if name in RANKS and value < 1:
        raise HFConfigError(f"config key '{key}' got {value}; a rank is 1 or more (LoRA "
                            "ranks are usually 4 to 64)")
    return value


def check_rank(config: Any, model: torch.nn.Module, key: str = KEY) -> None:
    """Refuse a rank (``r``, and each of ``rank_pattern``) larger than any weight matrix of
    ``model`` can have: peft would allocate that many rows and columns per adapted layer
    (``r: 1000000000`` is terabytes) for nothing a smaller rank cannot do."""
    ranks = [(f"{key}.{name}", getattr(config, name, None)) for name in RANKS]
    pattern = getattr(config, "rank_pattern", None)
    if isinstance(pattern, dict):
        ranks += [(f"{key}.rank_pattern.{k}", v) for k, v in pattern.items()]
    ranks = [(k, v) for k, v in ranks if v is not None]
    if not ranks:
        return
    bound, shape = 0, None
    for p in model.parameters():  # shapes only: nothing is read (meta tensors too)
        if p.dim() >= 2 and min(p.shape[0], p.numel() // max(1, p.shape[0])) > bound:
            bound, shape = min(p.shape[0], p.numel() // max(1, p.shape[0])), tuple(p.shape)
    for shown, rank in ranks:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise HFConfigError(f"config key '{shown}' got {short_repr(rank)}; a rank is an "
                                "integer, 1 or more")
        if bound and rank > bound:
            raise HFConfigError(
                f"config key '{shown}' got {rank}, more than the rank any weight matrix of "
                f"{type(model).__name__} can have ({bound}, its largest is "
                f"{' x '.join(map(str, shape or ()))}); use at most {bound} (LoRA ranks are "
                "usually 4 to 64)")
