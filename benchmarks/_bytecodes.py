"""Python work per step, counted: bytecode instructions and calls into C, per function.

A load-independent figure that runs anywhere (no valgrind, no hardware counters):
``sys.settrace`` with ``f_trace_opcodes`` counts every bytecode the main thread
executes, attributed to its function, and ``sys.setprofile`` counts the calls
from Python into C functions (each torch op, each ``list.append``). The tensor
math behind those calls is the same in two loops that do the same work, so the
difference between two loops' counts is what one does more than the other in
Python. Per step = (count(long) - count(short)) / (long - short): set-up and
final files cancel out. Other threads (a progress thread) are not counted, and
work done every N seconds happens more often per step under tracing (~30-100x
slower): the per-function table shows it where it matters.

    counts = Counts.measure(lambda: train(steps=100))
    counts.opcodes, counts.c_calls, counts.by_function[("loop.py", "train")]

Bytecodes differ between Python versions (each compiles the same source its own way);
:class:`OwnWork` counts what does not: the calls of one package's own functions, and its
lines (nearly so), the figures ``tests/trainer/test_per_step_work.py`` keeps.
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Any, Callable, Optional

Key = tuple[str, str]  # (file, function)


class Counts:
    """Bytecodes and C calls executed by the main thread while ``fn()`` ran.

    Example::

        counts = Counts.measure(lambda: sum(i * i for i in range(1000)))
        counts.opcodes > 1000      # True
    """

    def __init__(self) -> None:
        self.opcodes = 0
        self.c_calls = 0
        self.by_function: collections.Counter[Key] = collections.Counter()
        self.c_by_name: collections.Counter[str] = collections.Counter()  # C calls by callee
        self.result: Any = None

    @classmethod
    def measure(cls, fn: Callable[[], Any]) -> "Counts":
        counts = cls()
        by_code: collections.Counter[Any] = collections.Counter()

        def local(frame: Any, event: str, arg: Any) -> Optional[Callable]:
            if event == "opcode":
                by_code[frame.f_code] += 1
            return local

        def on_call(frame: Any, event: str, arg: Any) -> Optional[Callable]:
            frame.f_trace_opcodes = True
            return local

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "c_call":
                counts.c_by_name[getattr(arg, "__qualname__", None) or repr(arg)] += 1

        old_trace, old_profile = sys.gettrace(), sys.getprofile()
        sys.setprofile(profile)
        sys.settrace(on_call)
        try:
            counts.result = fn()
        finally:
            sys.settrace(old_trace)
            sys.setprofile(old_profile)
        for code, n in by_code.items():
            counts.by_function[(code.co_filename, qualname(code))] += n
        counts.opcodes = sum(by_code.values())
        counts.c_calls = sum(counts.c_by_name.values())
        return counts


def qualname(code: Any) -> str:
    """``Class.method`` where Python says it (3.11+), the bare function name on 3.10."""
    return getattr(code, "co_qualname", code.co_name)


# Comprehensions that Python 3.12+ runs inline (PEP 709): no call of their own there.
_INLINED = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>"})


class OwnWork:
    """The Python work one package's own code did while ``fn()`` ran (main thread):
    ``calls``, the calls of its functions (a generator's resumptions included; the
    comprehensions 3.12+ inlines left out), the same on every Python version, as they
    follow the source; and ``lines``, the line events in those functions (``sys.settrace``),
    which move a little between Python versions (how each reports a multi-line statement
    or a comprehension). Code outside ``root`` (torch, the standard library) is not traced
    line by line, so its cost and its version do not enter.

    Example::

        work = OwnWork.measure(lambda: trainer.train(), os.path.dirname(sailfin.__file__))
        work.calls, work.lines, work.by_function[("sailfin/.../trainer.py", "Loop._train_epoch")]
    """

    def __init__(self) -> None:
        self.calls = 0
        self.lines = 0
        self.by_function: collections.Counter[Key] = collections.Counter()  # calls
        self.lines_by_function: collections.Counter[Key] = collections.Counter()
        self.result: Any = None

    @classmethod
    def measure(cls, fn: Callable[[], Any], root: str) -> "OwnWork":
        work = cls()
        root = os.path.join(os.path.abspath(root), "")
        calls: collections.Counter[Any] = collections.Counter()
        lines: collections.Counter[Any] = collections.Counter()
        own: dict[Any, bool] = {}

        def local(frame: Any, event: str, arg: Any) -> Optional[Callable]:
            if event == "line":
                lines[frame.f_code] += 1
            return local

        def on_call(frame: Any, event: str, arg: Any) -> Optional[Callable]:
            code = frame.f_code
            mine = own.get(code)
            if mine is None:
                mine = own[code] = (code.co_filename.startswith(root)
                                    and code.co_name not in _INLINED)
            if not mine:
                return None
            calls[code] += 1
            return local

        old = sys.gettrace()
        sys.settrace(on_call)
        try:
            work.result = fn()
        finally:
            sys.settrace(old)
        for counter, by_function in ((calls, work.by_function),
                                     (lines, work.lines_by_function)):
            for code, n in counter.items():
                by_function[(os.path.relpath(code.co_filename, os.path.dirname(root[:-1])),
                             qualname(code))] += n
        work.calls, work.lines = sum(calls.values()), sum(lines.values())
        return work


def own_per_step(short: OwnWork, long: OwnWork, steps: int) -> dict[str, Any]:
    """``steps`` = long steps - short steps: calls, lines and both by function, per step."""
    if steps <= 0:
        raise ValueError("the long run must have more steps than the short one")

    def per(a: collections.Counter, b: collections.Counter) -> dict[Key, float]:
        return {k: (b[k] - a[k]) / steps for k in set(a) | set(b) if b[k] != a[k]}

    return {"calls": (long.calls - short.calls) / steps,
            "lines": (long.lines - short.lines) / steps,
            "by_function": per(short.by_function, long.by_function),
            "lines_by_function": per(short.lines_by_function, long.lines_by_function)}


def per_step(short: Counts, long: Counts, steps: int) -> dict[str, Any]:
    """``steps`` = long steps - short steps: opcodes, c_calls, by_function and c_by_name
    per step."""
    if steps <= 0:
        raise ValueError("the long run must have more steps than the short one")
    by_function = {key: (long.by_function[key] - short.by_function[key]) / steps
                   for key in set(long.by_function) | set(short.by_function)}
    return {"opcodes": (long.opcodes - short.opcodes) / steps,
            "c_calls": (long.c_calls - short.c_calls) / steps,
            "by_function": {k: v for k, v in by_function.items() if v},
            "c_by_name": {k: (long.c_by_name[k] - short.c_by_name[k]) / steps
                          for k in set(long.c_by_name) | set(short.c_by_name)}}
