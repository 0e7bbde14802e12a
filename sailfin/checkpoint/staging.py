"""An async save's copy to CPU memory, in two parts, on DCP's stagers: the optimizers'
state, which only the next optimizer step changes, is copied by the writing thread
during the next forward and backward; the rest before training goes on.

Example::

    stager = SplitStager(pinned=False)
    staged, fill = stager.stage(state, optimizer_storages(optimizers), step=120)
    executor.submit(lambda: (fill(), dcp.save(staged, storage_writer=writer)))
    ...                                  # the next forward and backward
    stager.settle()                      # before the optimizer step
"""

from __future__ import annotations

import functools
import operator
import threading
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Optional

import torch

from ..compat.torch import cpu_stager, version
from .errors import CheckpointError


def storage_key(tensor: torch.Tensor) -> tuple[int, str]:
    """Which storage ``tensor`` (or a DTensor's local rows) lives in."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return (local.untyped_storage().data_ptr(), str(local.device))


def optimizer_storages(optimizers: Iterable[torch.optim.Optimizer]) -> frozenset:
    """The storages of the optimizers' state: only an optimizer step changes them."""
    return frozenset(storage_key(value) for optimizer in optimizers
                     for state in optimizer.state.values() for value in state.values()
                     if isinstance(value, torch.Tensor))


@functools.lru_cache(maxsize=None)
def stager_reusable() -> bool:
    """Whether one ``DefaultStager`` stages more than once (torch 2.11's second ``stage``
    fails with ``KeyError: <class 'type'>``). Asked once per process, on a tiny tensor."""
    stager = cpu_stager(False)
    try:
        for _ in range(2):
            stager.stage({"probe": {"tensor": torch.zeros(1)}})
        return True
    except KeyError:
        return False
    finally:
        stager.close()


class SplitStager:
    """DCP's :class:`DefaultStager` twice: one copies the state now, the other the tensors
    whose storages are in ``later``, in the writing thread (each reuses its CPU copies
    where torch's stager can stage twice)."""

    def __init__(self, pinned: bool) -> None:
        self._pinned = pinned
        self._now, self._later = cpu_stager(pinned), cpu_stager(pinned)
        self._reuse = stager_reusable()
        self._staged_once = False
        # The last save's copy in the thread: (done, [(tensor, version at the save)], step)
        self._copy: Optional[tuple[Future, list[tuple[torch.Tensor, int]], int]] = None
        self._settled = False  # the training thread waited for it
        self._consistent: Optional[bool] = None  # what the first check of it found
        self._lock = threading.Lock()  # the training thread and rank 0's commit ask

    def stage(self, state: dict[str, Any], later: frozenset, step: int
              ) -> tuple[dict[str, Any], Callable[[], None]]:
        """A CPU copy of ``state`` but the tensors in ``later``, and what copies those
        into it (called by the writing thread; :meth:`settle` waits for it)."""
        deferred: list[tuple[tuple, torch.Tensor]] = []
        tree = _split(state, later, deferred, ()) if later else state
        if self._staged_once and not self._reuse:  # the last save's thread is done with them
            self._now, self._later = cpu_stager(self._pinned), cpu_stager(self._pinned)
        self._staged_once = True
        staged = self._now.stage(tree)
        copied: Future = Future()
        tensors = [tensor for _, tensor in deferred]
        with self._lock:
            self._copy = (copied, [(t, version(t)) for t in tensors], step) if tensors else None
            self._settled, self._consistent = False, None
        later_stager = self._later

        def fill() -> None:
            try:
                copies = later_stager.stage(dict(enumerate(tensors))) if tensors else {}
                for (path, _), copy in zip(deferred, copies.values()):
                    functools.reduce(operator.getitem, path[:-1], staged)[path[-1]] = copy
            except BaseException as exc:
                copied.set_exception(exc)
                raise
            copied.set_result(None)
        return staged, fill

    def settle(self) -> bool:
        """Before the optimizer step: wait for the copy ``fill`` makes (True: there was one,
        not settled before); raise if the optimizers' state changed meanwhile."""
        with self._lock:
            if self._copy is None or self._settled:
                return False
            self._settled = True
        try:
            consistent = self.consistent()
        except Exception as exc:  # the copy failed: the writer refuses that save too
            raise CheckpointError(f"copying the optimizers' state of step {self._copy[2]} "
                                  f"to CPU memory failed: {exc}") from exc
        if not consistent:
            raise CheckpointError(self.refusal())
        return True

    def consistent(self) -> bool:
        """Whether the last save's copy holds the state as it was at the save (waits for
        it). Any thread may ask; once the copy is done, the first answer stands."""
        with self._lock:
            if self._copy is None:
                return True
            if self._consistent is None:
                copied, versions, _ = self._copy
                copied.result()
                self._consistent = all(version(t) == seen for t, seen in versions)
            return self._consistent

    def refusal(self) -> str:
        step = self._copy[2] if self._copy is not None else "?"
        return (f"the optimizers' state changed after the async save of step {step} began "
                "and before the next optimizer step (an optimizer stepped outside the "
                "training step, in a callback or the recipe's forward), so that save is not "
                "the state of one step: set trainer.checkpoint.async_save: false")

    def close(self) -> None:
        self._now.close()
        self._later.close()


def _split(value: Any, storages: frozenset, deferred: list, path: tuple) -> Any:
    """``value`` with each tensor in ``storages`` (reached through dicts and lists) left
    as None and listed in ``deferred`` with its path."""
    if isinstance(value, torch.Tensor):
        if storage_key(value) in storages:
            deferred.append((path, value))
            return None
        return value
    if isinstance(value, dict):
        return {k: _split(v, storages, deferred, path + (k,)) for k, v in value.items()}
    if isinstance(value, list):
        return [_split(v, storages, deferred, path + (i,)) for i, v in enumerate(value)]
    return value
