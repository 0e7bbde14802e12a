"""PyMarlin's forms of a recipe's returns and callbacks, accepted and made exact
(docs/migrating-from-pymarlin.md): ``train_step``'s ``(loss, t1, t2, ...)``, whose
extras go to ``on_end_train_step``; ``val_step``'s tuple, whose gathered columns go to
``on_end_val_epoch`` by position; a 0-d ``val_step`` tensor, a batch mean repeated once
per sample; callbacks with shorter signatures (read once, when the loop is built)."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Optional

import torch

from ...interfaces import ModuleInterface


class Extras(tuple):
    """PyMarlin's extra ``train_step`` outputs (``(loss, t1, t2)`` -> ``Extras((t1, t2))``)."""


def unpack(out: Any) -> tuple[Any, Any]:
    """``train_step``'s return as ``(loss, stats)``; ``stats`` is a dict, None or Extras."""
    if type(out) is not tuple:
        return out, None
    if len(out) == 2 and (out[1] is None or isinstance(out[1], Mapping)):
        return out[0], out[1]
    return out[0], Extras(out[1:])


def train_step_end_caller(module: ModuleInterface) -> Optional[Callable[[int, Any, Any], None]]:
    """``module.on_end_train_step`` called with what its signature takes, or None."""
    if getattr(type(module), "on_end_train_step", None) is ModuleInterface.on_end_train_step:
        return None
    hook = module.on_end_train_step
    takes = _positional_count(hook)

    def call(global_step: int, loss: Any, stats: Any) -> None:
        args = (global_step, loss) + (tuple(stats) if isinstance(stats, Extras) else (stats,))
        hook(*(args if takes is None else args[:takes]))

    return call


class CallbackSignatureError(TypeError):
    """A recipe callback's signature cannot take what the trainer passes it."""


def val_epoch_end_caller(module: ModuleInterface, check_only: bool = False
                         ) -> Callable[[int, dict, str], Any]:
    """``module.on_end_val_epoch``: tuple outputs (PyMarlin) are passed by position, as
    PyMarlin passed them, ``(global_step, *columns, key=name)`` (into ``*inputs`` or into
    named parameters such as ``(global_step, losses, logits, labels, key="default")``);
    dict outputs are passed as ``(global_step, outputs, name)``.

    ``check_only``: the returned function checks that the signature takes those
    arguments (:class:`CallbackSignatureError` if not) without calling the callback,
    whose side effects (a count, a file, a scheduler step) could not be put back."""
    hook = module.on_end_val_epoch
    takes = _positional_count(hook)
    try:
        signature: Optional[inspect.Signature] = inspect.signature(hook)
    except (TypeError, ValueError):
        signature = None
    params = signature.parameters if signature is not None else {}
    keyed = "key" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    # PyMarlin's on_end_val_epoch(self, global_step, *inputs, key="default")
    spread = takes is None and "key" in params

    def arguments(global_step: int, outputs: dict, name: str) -> tuple[tuple, dict]:
        if outputs and list(outputs) == [str(i) for i in range(len(outputs))]:
            # val_step returned a tuple: PyMarlin's on_end_val_epoch(global_step, *inputs)
            columns = tuple(outputs.values())
            kwargs = {"key": name} if keyed or signature is None else {}
            try:
                if signature is not None:
                    signature.bind(global_step, *columns, **kwargs)
            except TypeError as err:
                count = len(columns)
                raise CallbackSignatureError(
                    f"on_end_val_epoch{signature} cannot take what val_step's tuple gives "
                    f"it: global_step, its {count} column(s) by position and key=: {err}; "
                    f"take (global_step, {', '.join(f'c{i}' for i in range(count))}, "
                    "key=\"default\") or (global_step, *outputs, key=\"default\")") from None
            return (global_step, *columns), kwargs
        if spread:
            return (global_step, outputs), {"key": name}
        args = (global_step, outputs, name)
        args = args if takes is None else args[:max(takes, 2)]
        if signature is not None:
            try:
                signature.bind(*args)
            except TypeError as err:
                raise CallbackSignatureError(
                    f"on_end_val_epoch{signature} cannot take (global_step, outputs, key): "
                    f"{err}; take (global_step, outputs, key=\"default\")") from None
        return args, {}

    def call(global_step: int, outputs: dict, name: str) -> Any:
        args, kwargs = arguments(global_step, outputs, name)
        return None if check_only else hook(*args, **kwargs)

    return call


def batch_size(batch: Any, out: Any = None) -> int:
    """The number of samples in ``batch``: another per-sample output's length, else the
    first tensor's first dimension in the batch (tensors, tuples, lists, dicts); else 1."""
    if isinstance(out, Mapping):
        for value in out.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                return int(value.shape[0])
    found = _first_tensor(batch)
    return int(found.shape[0]) if found is not None and found.dim() > 0 else 1


def _first_tensor(batch: Any) -> Optional[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return batch
    items = batch.values() if isinstance(batch, Mapping) else \
        batch if isinstance(batch, (tuple, list)) else ()
    for item in items:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


def _positional_count(hook: Callable) -> Optional[int]:
    """How many positional arguments ``hook`` takes (None: any number, ``*args``)."""
    try:
        kinds = [p.kind for p in inspect.signature(hook).parameters.values()]
    except (TypeError, ValueError):
        return None
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        return None
    return sum(k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
               for k in kinds)
