"""Deferred construction: build a recipe without allocating its parameters, initialise
them later where they live, to the values an eager build would have drawn.

``deferred_build(MyRecipe, data=data)`` constructs the recipe under a recorder: a
tensor made by ``torch.empty`` (what ``nn.Linear`` and every PyTorch layer create
their parameters with) lands on the meta device, so nothing is allocated; small
tensors made by deterministic factories (``torch.ones``, ``torch.arange`` ...) stay
real. Every initialisation call the construction makes (a module's
``reset_parameters()``, ``_reset_parameters()``, ``reset_running_stats()`` or
``init_weights()``) is recorded in order with the state of the CPU random generator
at that moment (so a ``torch.manual_seed`` in a recipe's ``__init__`` is honoured).

The backend then places the module (the fsdp backends first shard it, so that each
parameter is a DTensor holding this rank's rows) and calls
:meth:`InitPlan.materialize`: it replays the calls in order, each on full-size CPU
tensors of that call's module only, drawn from the same generator on every rank,
and keeps the rows this rank owns. The result equals an eager build on every
world size and backend; memory holds one call's module at a time.

Example::

    model = deferred_build(MyRecipe, data=MyData(), hidden=4096)   # no weights yet
    Trainer(model, TrainerArguments(backend="fsdp")).train()
"""

from __future__ import annotations

import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..checkpoint.weights import local_index
from ..config.errors import ConfigError

INIT_METHODS = ("reset_parameters", "_reset_parameters", "reset_running_stats", "init_weights")
PLAN_ATTRIBUTE = "_sailfin_init_plan"
_RANDOM = {torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal,
           torch.bernoulli, torch.poisson, torch.multinomial, torch.rand_like,
           torch.randn_like, torch.randint_like}
_FACTORIES = {torch.rand, torch.randn, torch.randint, torch.randperm}
_UNALLOCATED = {torch.empty, torch.empty_strided}
_SENTINEL_SEED = 0x5A11F1_0000


class DeferredInitError(ConfigError):
    """A recipe's initialisation cannot be deferred; the message names where and why."""


@dataclass
class _Call:
    module: nn.Module
    method: str
    args: dict[str, Any]
    rng_state: torch.Tensor
    reseeded: bool  # the recipe set the generator (manual_seed) since the previous call


@dataclass
class InitPlan:
    """The initialisation calls of a deferred build, in order; see the module docstring."""

    calls: list[_Call] = field(default_factory=list)

    def materialize(self, module: nn.Module, device: torch.device) -> None:
        """Allocate ``module``'s deferred tensors on ``device`` (sharded parameters: this
        rank's rows only) and replay the initialisation calls into them."""
        kept = _real_tensors(module)
        module.to_empty(device=device)
        with torch.no_grad():  # to_empty replaced buffers: look each one up again
            for table, name, value in kept:
                _local(getattr(table[0], table[1])[name]).copy_(value)
        saved = torch.get_rng_state()
        try:
            for call in self.calls:
                if call.reseeded:
                    torch.set_rng_state(call.rng_state)
                _replay(call)
        finally:
            torch.set_rng_state(saved)  # the run's own random streams are not consumed
        self.calls = []
        for sub in module.modules():  # the recipe, also inside a wrapper
            if sub.__dict__.get(PLAN_ATTRIBUTE) is self:
                delattr(sub, PLAN_ATTRIBUTE)


def init_plan(module: nn.Module) -> Optional[InitPlan]:
    """The plan of a module built by :func:`deferred_build` and not yet materialised."""
    return getattr(module, PLAN_ATTRIBUTE, None)


def deferred_build(factory: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> nn.Module:
    """``factory(*args, **kwargs)`` with its parameters deferred (see the module docstring).
    Build the data interface before, outside: only the module is deferred.

    Raises :class:`DeferredInitError` naming the module when its initialisation cannot
    be replayed (random values drawn, or parameters filled, outside an init method)."""
    recorder = _Recorder()
    before = torch.get_rng_state()
    torch.default_generator.manual_seed(_SENTINEL_SEED)
    recorder.sentinel = torch.get_rng_state()
    recorder.current = before
    try:
        with recorder:
            module = factory(*args, **kwargs)
    finally:
        now = torch.get_rng_state()
        torch.set_rng_state(recorder.current if torch.equal(now, recorder.sentinel) else now)
    _check_covered(module, recorder.covered)
    setattr(module, PLAN_ATTRIBUTE, InitPlan(recorder.calls))
    return module


class _Recorder(TorchFunctionMode):
    """Sends unallocated factories to meta; records init calls; refuses what cannot replay."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[_Call] = []
        self.covered: set[int] = set()   # ids of meta tensors an init call filled
        self.sentinel = torch.empty(0)
        self.current = torch.empty(0)    # the generator's real state at the last call
        self._frame: Any = None          # the init call the last in-place op came from

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in _RANDOM and kwargs.get("generator") is None and _meta_or_new(func, args):
            if _outermost_init_call() is None:
                raise DeferredInitError(
                    f"deferred build: {_user_site()} draws random values with "
                    f"torch.{func.__name__} outside an init method; under trainer.backend fsdp "
                    "the model is built on the meta device and initialised later, so draw "
                    "them in the module's reset_parameters() or init_weights() (or set "
                    "trainer.fsdp.meta_build false)")
            if func in _FACTORIES and kwargs.get("device") is None:
                kwargs["device"] = "meta"  # replayed later, on the CPU generator
        elif func in _UNALLOCATED and kwargs.get("device") is None:
            kwargs["device"] = "meta"
        else:
            # Tensor methods get the tensor first; torch.nn.init functions as tensor=.
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                self._seen(func, target)
        return func(*args, **kwargs)

    def _seen(self, func: Any, tensor: torch.Tensor) -> None:
        """A meta tensor used: inside an init call, that call fills it (some torch.nn.init
        functions skip meta tensors, so any use counts); outside, filling it is an error."""
        found = _outermost_init_call()
        if found is None:
            if not _is_inplace(func):
                return
            raise DeferredInitError(
                f"deferred build: {_user_site()} fills a parameter in place "
                f"({getattr(func, '__name__', func)}) outside an init method; under "
                "trainer.backend fsdp the model is built on the meta device, so move this "
                "into the module's reset_parameters() or init_weights() (or set "
                "trainer.fsdp.meta_build false)")
        frame, module, method = found
        if frame is not self._frame:
            self._frame = frame
            state = torch.get_rng_state()
            reseeded = not self.calls or not torch.equal(state, self.sentinel)
            if not torch.equal(state, self.sentinel):
                self.current = state
            self.calls.append(_Call(module, method, _call_args(frame, module, method),
                                    self.current, reseeded))
            # Any manual_seed before the next call shows as a state other than this one.
            torch.default_generator.manual_seed(_SENTINEL_SEED)
        base = tensor
        while base._base is not None:
            base = base._base
        self.covered.add(id(base))
        self.covered.add(id(tensor))


def _meta_or_new(func: Any, args: tuple) -> bool:
    if func in (torch.rand_like, torch.randn_like, torch.randint_like, torch.normal,
                torch.bernoulli, torch.poisson, torch.multinomial):
        return any(isinstance(a, torch.Tensor) and a.is_meta for a in args)
    return True


def _is_inplace(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name == "__setitem__"


def _outermost_init_call() -> Optional[tuple[Any, nn.Module, str]]:
    frame, found = sys._getframe(2), None
    while frame is not None:
        if frame.f_code.co_name in INIT_METHODS:
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module):
                found = (frame, owner, frame.f_code.co_name)
        frame = frame.f_back
    return found


def _user_site() -> str:
    """file:line of the innermost frame outside torch and this file."""
    frame = sys._getframe(2)
    torch_dir = os.path.dirname(torch.__file__)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(torch_dir) and path != __file__:
            return f"{os.path.basename(path)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "the recipe"


def _call_args(frame: Any, module: nn.Module, method: str) -> dict[str, Any]:
    try:
        params = inspect.signature(getattr(module, method)).parameters
    except (TypeError, ValueError):
        return {}
    return {name: frame.f_locals[name] for name, p in params.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name in frame.f_locals}


def _check_covered(module: nn.Module, covered: set[int]) -> None:
    for path, sub in module.named_modules():
        for kind, tensors in (("parameter", sub._parameters), ("buffer", sub._buffers)):
            for name, tensor in tensors.items():
                if tensor is not None and tensor.is_meta and id(tensor) not in covered:
                    where = f"{path}.{name}" if path else name
                    raise DeferredInitError(
                        f"deferred build: {kind} '{where}' of {type(sub).__name__} is "
                        "initialised by no reset_parameters() or init_weights(), so it cannot "
                        "be built on the meta device and initialised later (trainer.backend "
                        f"fsdp); give {type(sub).__name__} a reset_parameters() that fills it, "
                        "or set trainer.fsdp.meta_build false")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _real_tensors(module: nn.Module) -> list[tuple[tuple[nn.Module, str], str, torch.Tensor]]:
    """((module, table), name, a copy of its local values) for each tensor built for real."""
    kept, seen = [], set()
    for sub in module.modules():
        for table in ("_parameters", "_buffers"):
            for name, tensor in getattr(sub, table).items():
                if tensor is None or id(tensor) in seen or tensor.is_meta:
                    continue
                seen.add(id(tensor))
                kept.append(((sub, table), name, _local(tensor).detach().clone()))
    return kept


def _replay(call: _Call) -> None:
    """Run one recorded init call on full-size CPU copies of its module's tensors, then
    keep the rows each tensor holds here (all of them for an unsharded tensor)."""
    swapped: list[tuple[dict, str, torch.Tensor, torch.Tensor]] = []
    fulls: dict[int, torch.Tensor] = {}
    for sub in call.module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, tensor in list(table.items()):
                if tensor is None or not (tensor.is_meta or _is_dtensor(tensor)):
                    continue  # real and whole: the call fills it in place
                full = fulls.get(id(tensor))
                if full is None:
                    full = torch.empty(tensor.shape, dtype=tensor.dtype)
                    if _is_dtensor(tensor):
                        full[_rows(tensor)] = tensor.to_local().detach().cpu()
                    if isinstance(tensor, nn.Parameter):
                        full = nn.Parameter(full, requires_grad=tensor.requires_grad)
                    fulls[id(tensor)] = full
                table[name] = full
                swapped.append((table, name, tensor, full))
    try:
        getattr(call.module, call.method)(**call.args)
    finally:
        done: set[int] = set()
        with torch.no_grad():
            for table, name, tensor, full in swapped:
                table[name] = tensor
                if _is_dtensor(tensor) and id(tensor) not in done:
                    done.add(id(tensor))
                    tensor.to_local().copy_(full.detach()[_rows(tensor)])


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "device_mesh") and hasattr(tensor, "to_local")


def _rows(tensor: Any) -> tuple[slice, ...]:
    """The index of this rank's piece of a DTensor in the full tensor."""
    index = local_index(tensor)
    assert index is not None
    return index
