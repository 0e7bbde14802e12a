"""``final/bare.safetensors``: the final weights under the names of the recipe's model
itself, so that the bare ``nn.Module`` loads them without renaming. A recipe usually
holds its whole model in one attribute (``self.net``, ``self.model``):
``final/model.safetensors`` names its tensors as the recipe does (``net.0.weight``),
``final/bare.safetensors`` as that attribute does (``0.weight``)::

    net.load_state_dict(safetensors.torch.load_file("outputs/run/final/bare.safetensors"))

It is written only when one attribute holds every weight and buffer the recipe saves,
and the recipe does not opt out (``save_bare_weights = False``; ``sailfin.hf`` does:
its ``final/hf/`` is the bare model).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

BARE = "bare.safetensors"


def model_attribute(module: torch.nn.Module) -> Optional[str]:
    """The name of the one child of ``module`` that holds all its saved state, or None."""
    if not getattr(module, "save_bare_weights", True):
        return None
    children = {name for name, _ in module.named_children()}
    heads = {name.split(".", 1)[0] for name in module.state_dict(keep_vars=True)}
    if len(heads) != 1:
        return None
    (head,) = heads
    return head if head in children else None


def save_bare_weights(module: torch.nn.Module, backend: Any, final_dir: str,
                      write: bool) -> Optional[dict[str, str]]:
    """Write ``final_dir/bare.safetensors`` as the backend writes the final weights (every
    rank calls it: fsdp gathers one tensor at a time); what the summary says of it."""
    attribute = model_attribute(module)
    if attribute is None:
        return None
    path = os.path.join(final_dir, BARE)
    backend.save_final_weights(getattr(module, attribute), path, write)
    return {"file": os.path.join("final", BARE), "attribute": attribute}
