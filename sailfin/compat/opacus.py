"""Opacus's private attributes sailfin relies on, each in one place with why.

``DPOptimizer`` keeps, between ``signal_skip_step`` and ``step``, a queue of skip signals
(``_step_skip_queue``) and whether the last step was skipped (``_is_last_step_skipped``:
whether ``zero_grad`` keeps the summed clipped gradients). A step that never reaches the
optimizer (a non-finite loss skipped it) leaves both behind, and Opacus has no public
call to drop them (no ``DPOptimizer.reset``), so sailfin clears them here.
"""

from __future__ import annotations

from typing import Any

#: The private attributes of ``opacus.optimizers.DPOptimizer`` used below.
OPTIMIZER_ATTRIBUTES = ("_step_skip_queue", "_is_last_step_skipped")


def drop_pending_step(optimizer: Any) -> None:
    """Forget what an unfinished step left in ``optimizer`` (a ``DPOptimizer``): its
    micro-batches' skip signals, and the clipped sums and per-sample gradients they held."""
    optimizer._step_skip_queue.clear()
    optimizer._is_last_step_skipped = False
    for p in optimizer.params:
        p.grad_sample = None
        p.summed_grad = None
    for held in getattr(optimizer, "grad_state", {}).values():  # the FSDP optimizer's sums
        held["summed_grad"] = None


def missing() -> list[str]:
    """The dotted names of the private attributes above that the installed Opacus lacks."""
    import torch
    from opacus.optimizers import DPOptimizer

    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = DPOptimizer(torch.optim.SGD([param], lr=0.1), noise_multiplier=0.0,
                            max_grad_norm=1.0, expected_batch_size=1)
    return [f"opacus.optimizers.DPOptimizer.{name}" for name in OPTIMIZER_ATTRIBUTES
            if not hasattr(optimizer, name)]
