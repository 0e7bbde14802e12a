"""This process's memory: its peak, freed memory handed back to the system, and the
garbage collector spared while a run is built."""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
from typing import Callable, Iterator, Optional

from ..compat.python import program_froze_objects


def peak_rss_bytes() -> Optional[int]:
    """The most resident memory this process has held; ``None`` where the platform cannot
    tell (Windows).

    On Linux it is ``VmHWM`` from ``/proc/self/status``, which starts afresh when a
    program starts. ``getrusage``'s ``ru_maxrss`` does not: it keeps the peak of the
    process image before ``exec``, so a worker started by a large parent (a test runner,
    a notebook) would report the parent's size.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:
        return None
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024  # macOS bytes, Linux KiB


def release_free_memory() -> None:
    """Give the memory the C allocator keeps after ``free`` back to the system (glibc's
    ``malloc_trim``); nothing where the C library has no such call.

    A collective library (gloo) allocates and frees large buffers in threads of its
    own, and glibc keeps those freed pages in the threads' arenas: a loop of gathers
    would otherwise grow the resident memory by about one buffer per iteration: call it
    after each gather.
    """
    trim = _libc("malloc_trim")
    if trim is not None:
        trim(0)


def fix_mmap_threshold(size: int = 1 << 20) -> bool:
    """Have the C allocator map each block of ``size`` bytes or more on its own, and
    unmap it when freed (glibc's ``mallopt(M_MMAP_THRESHOLD)``); False where the C
    library has no such call.

    By default glibc raises this threshold to the size of each large block freed, so
    after a few gathers of a sharded model's units (tens of MB each) those buffers come
    from heaps it keeps: the resident memory then holds units no tensor uses any more.
    Call it before the first gather.
    """
    mallopt = _libc("mallopt")
    return mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, int(size)))


_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


@functools.cache
def _libc(name: str) -> Optional[Callable[..., int]]:
    try:
        import ctypes

        return getattr(ctypes.CDLL(None), name, None)
    except (OSError, TypeError):  # no C library handle (Windows)
        return None


@contextlib.contextmanager
def gc_spares_existing_objects() -> Iterator[None]:
    """While inside, Python's cyclic garbage collector leaves alone the objects that
    already exist (``gc.freeze``); they are its again on leaving, whatever happened.

    Building a run creates many objects (the first optimizer imports ``torch._dynamo``),
    and each full collection that this sets off walks every object alive: torch's,
    transformers', the recipe's. On a short run measured here, those walks took a third
    of the run's time. Objects are freed by reference counting as ever; only garbage in
    reference cycles made before entering waits for the first collection after leaving.
    A program that froze objects itself (``gc.get_freeze_count()``, less those the
    interpreter froze at start: :func:`sailfin.compat.python.frozen_at_start`) is left
    as it is.

    Example::

        with gc_spares_existing_objects():
            build_run(trainer)
    """
    if program_froze_objects():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
