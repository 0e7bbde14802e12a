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
"""

from __future__ import annotations

import collections
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
            name = getattr(code, "co_qualname", code.co_name)  # co_qualname: Python 3.11+
            counts.by_function[(code.co_filename, name)] += n
        counts.opcodes = sum(by_code.values())
        counts.c_calls = sum(counts.c_by_name.values())
        return counts


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
