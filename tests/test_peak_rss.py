"""Peak memory figures (summary.json's cpu_rss_bytes, the fsdp memory test and
benchmark) are the process's own, not those of the process that started it."""

import subprocess
import sys

from sailfin.utils.memory import peak_rss_bytes

CHILD = ("import resource; from sailfin.utils.memory import peak_rss_bytes; "
         "print(peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")


def test_a_child_of_a_large_parent_reports_its_own_peak():
    held = bytearray(400 * 2**20)  # touched: resident in this (the parent) process
    held[::4096] = b"\1" * len(held[::4096])
    assert peak_rss_bytes() >= 400 * 2**20
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    ours, rusage = int(out[0]), int(out[1])
    assert ours < 200 * 2**20, ours  # a bare interpreter: tens of MiB
    # On Linux getrusage keeps the pre-exec image's peak (the figure this replaced).
    if sys.platform.startswith("linux"):
        assert rusage >= 400 * 2**20, rusage
    del held

