"""transformers' private attributes sailfin reads, each with why.

Example::

    no_split_modules(GPT2LMHeadModel(cfg))   # ['GPT2Block']
"""

from __future__ import annotations

from typing import Any

PRIVATE = ("transformers.PreTrainedModel._no_split_modules",)
"""The dotted names sailfin reads; :func:`missing` checks each."""


def no_split_modules(module: Any) -> list[str]:
    """The class names a Hugging Face model says must not be split across devices (its
    repeated blocks); empty for any other module.

    Private: ``PreTrainedModel._no_split_modules``, which Accelerate's ``device_map`` and
    FSDP auto-wrap policies read. Public alternative: none; without it sailfin guesses
    the blocks from the model's largest ``ModuleList``.
    """
    return list(getattr(module, "_no_split_modules", None) or [])


def missing() -> list[str]:
    """The names in :data:`PRIVATE` the installed transformers lacks (empty: all present,
    or transformers is not installed, so no model has the attribute)."""
    try:
        import transformers
    except ImportError:
        return []
    return [name for name in PRIVATE
            if not hasattr(transformers.PreTrainedModel, name.rpartition(".")[2])]
