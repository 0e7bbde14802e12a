"""Compiled execution: ``torch.compile`` of the step runner.

The recipe's ``train_step`` calls its own submodules, so compiling the model's
``forward`` alone would miss the loss and anything else the step does; the
step runner (``StepRunner``) is compiled instead, in place
(``nn.Module.compile``), so parameter names and ``state_dict`` keys do not
change. It is compiled before a strategy wraps it: PyTorch's advice for DDP
is to compile the inner module and wrap the compiled one.

Compilation itself happens at the first step (and again only for a new input
shape, e.g. an epoch's short last batch unless ``trainer.drop_last``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch


class CompileError(RuntimeError):
    """torch.compile could not compile the recipe's step; the message says why."""


def compile_in_place(runner: torch.nn.Module, mode: str) -> None:
    """Make ``runner(...)`` run through torch.compile (compiled lazily, on first call)."""
    runner.compile(mode=None if mode == "default" else mode)


def explain_failures(run: Callable[..., Any], recipe: str) -> Callable[..., Any]:
    """``run`` with compiler errors re-raised as :class:`CompileError` naming the way out."""
    from ..compat.torch import compiler_error

    TorchDynamoException = compiler_error()

    def guarded(*args: Any) -> Any:
        try:
            return run(*args)
        except TorchDynamoException as exc:
            reason = str(exc).strip().split("\n\n")[0]
            raise CompileError(
                f"torch.compile could not compile {recipe}.train_step: "
                f"{type(exc).__name__}: {reason}\n"
                "Run it eagerly with trainer.compile: false (--trainer.compile false); if the "
                "error remains without compilation, it is in the recipe.") from exc

    return guarded
