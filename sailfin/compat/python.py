"""What one CPython release does differently that sailfin must allow for, each in one
function with the releases it concerns.

Example::

    if program_froze_objects():   # gc.freeze() called by the program, not the interpreter
        ...
"""

from __future__ import annotations

import functools
import gc
import subprocess
import sys
from typing import Optional


@functools.lru_cache(maxsize=None)
def frozen_at_start() -> Optional[int]:
    """How many objects this Python's permanent generation (``gc.freeze``) holds before any
    program code runs: 0 on CPython 3.10, 3.11 and 3.13; a few hundred on 3.12 (375 on
    3.12.1), objects the interpreter leaves there itself. ``None`` where it cannot tell (no
    ``sys.executable`` to ask, as when Python is embedded).

    Asked of a fresh interpreter of the same executable (isolated, no ``site``: the count
    is the interpreter's alone), once per process.
    """
    if not sys.executable:
        return None
    try:
        done = subprocess.run([sys.executable, "-I", "-S", "-c",
                               "import gc; print(gc.get_freeze_count())"],
                              capture_output=True, text=True, timeout=60, check=True)
        return int(done.stdout.strip())
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def program_froze_objects() -> bool:
    """Whether objects are frozen (``gc.freeze``) other than those the interpreter froze
    at start: whether the program froze some itself. On a Python whose count starts at 0,
    no process is started to ask."""
    count = gc.get_freeze_count()
    return count > 0 and count != frozen_at_start()


def missing() -> list[str]:
    """The names above that the running Python lacks (``gc.get_freeze_count``: 3.7+)."""
    return [f"gc.{name}" for name in ("get_freeze_count", "freeze", "unfreeze")
            if not hasattr(gc, name)]
