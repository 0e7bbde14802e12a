"""A recipe that runs out of memory (``torch.OutOfMemoryError``, as CUDA raises it) on
micro-batches above a size, for the ``micro_batch_size: auto`` tests."""

from __future__ import annotations

from typing import Optional

import torch

from tests.recipes import LinearRecipe


class OomRecipe(LinearRecipe):
    """``limit``: a micro-batch of more samples raises out of memory in its forward (a
    step's first one only above twice the limit when ``after_first``: then a later one
    fails after the first one's gradients exist). ``limit_rank``: only that rank is limited."""

    def __init__(self, data, limit: int, after_first: bool = False,
                 limit_rank: Optional[int] = None, rank: int = 0, **kw) -> None:
        super().__init__(data, **kw)
        self.limit, self.after_first = limit, after_first
        self.limited = limit_rank is None or limit_rank == rank
        self.ooms = 0
        self._micro_in_step = 0

    def train_step(self, global_step, batch, device):
        ids = batch[0].tolist()
        if self._pending and not self.padding_batch and ids[0] == self._pending[0]:
            # The step runs again from its first micro-batch (the same first sample):
            # the failed attempt's samples were not trained on.
            self._pending, self._micro_in_step = [], 0
        self._micro_in_step += 1
        # after_first: a step's first micro-batch has twice the room (its gradients
        # exist when a later one fails).
        room = 2 * self.limit if self.after_first and self._micro_in_step == 1 else self.limit
        if self.limited and len(ids) > room:
            self.ooms += 1
            self._micro_in_step = 0
            self._pending = []
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (test): micro-batch of {len(ids)} > {self.limit}")
        return super().train_step(global_step, batch, device)

    def on_end_train_step(self, global_step, loss, stats):
        self._micro_in_step = 0
        super().on_end_train_step(global_step, loss, stats)
