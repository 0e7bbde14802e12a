"""Padding per micro-batch: each batch to its own longest sample, not to max_length."""

from __future__ import annotations

from typing import Any, Optional

import torch


class PadCollate:
    """Turns a list of ``{"input_ids": [...], "labels": ...}`` into padded tensors.

    ``input_ids`` are padded with ``pad_id`` and get an ``attention_mask``; list labels
    (token tags, targets) are padded with ``label_pad`` (-100: skipped by the loss);
    int labels become a 1-D tensor. ``causal``: the labels are the inputs, with padding
    set to -100.

    Example::

        collate = PadCollate(pad_id=0, label_pad=-100)
        batch = collate([{"input_ids": [5, 6, 7], "labels": [1, 2, 1]},
                         {"input_ids": [5], "labels": [0]}])
        batch["input_ids"].shape      # torch.Size([2, 3])
    """

    def __init__(self, pad_id: int, label_pad: Optional[int] = -100, causal: bool = False
                 ) -> None:
        self.pad_id, self.label_pad, self.causal = pad_id, label_pad, causal

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [s["input_ids"] for s in samples]
        input_ids = _pad(ids, self.pad_id)
        mask = _pad([[1] * len(x) for x in ids], 0)
        batch = {"input_ids": input_ids, "attention_mask": mask}
        if self.causal:
            batch["labels"] = input_ids.masked_fill(mask == 0, -100)
        elif "labels" in samples[0]:
            labels = [s["labels"] for s in samples]
            if isinstance(labels[0], list):
                batch["labels"] = _pad(labels, -100 if self.label_pad is None else self.label_pad)
            else:
                batch["labels"] = torch.tensor(labels, dtype=torch.long)
        return batch


def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    longest = max(len(r) for r in rows)
    out = torch.full((len(rows), longest), value, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.as_tensor(r, dtype=torch.long)
    return out
