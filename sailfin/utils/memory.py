"""This process's peak resident memory, in bytes."""

from __future__ import annotations

import sys
from typing import Optional


def peak_rss_bytes() -> Optional[int]:
    """The most resident memory this process has held; ``None`` where the platform cannot
    tell (Windows).

    On Linux it is ``VmHWM`` from ``/proc/self/status``, which starts afresh when a
    program starts. ``getrusage``'s ``ru_maxrss`` does not: it keeps the peak of the
    process image before ``exec``, so a worker started by a large parent (a test runner,
    a notebook) would report the parent's size.

    Example::

        before = peak_rss_bytes()
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
