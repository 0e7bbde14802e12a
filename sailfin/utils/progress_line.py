"""A line now and then while a long job runs: how many done, how fast, how many in all
(a job shorter than the interval says nothing).

Example::

    line = ProgressLine("tokenizing train.jsonl", "rows", total=120_000)
    for part in parts:
        line.add(len(part))      # "sailfin: tokenizing train.jsonl: 24,000 of 120,000 rows
    line.close()                 #  (20%), 2,310 rows/s" at most every 10 s; then the total
"""

from __future__ import annotations

import time
from typing import IO, Optional

from .voice import say

REPORT_SECONDS = 10.0


class ProgressLine:
    """Counts ``unit``s done; prints a line to ``stream`` (stderr) when ``interval``
    seconds passed since the last one, and a closing line with the count and the rate.
    ``enabled=False`` counts without printing (the other ranks of a job)."""

    def __init__(self, what: str, unit: str, total: Optional[int] = None,
                 interval: Optional[float] = None, stream: Optional[IO[str]] = None,
                 enabled: bool = True) -> None:
        self.what, self.unit, self.total, self.enabled = what, unit, total, enabled
        self.interval = REPORT_SECONDS if interval is None else interval
        self.stream = stream
        self.done = 0
        self._said = False
        self._start = time.perf_counter()
        self._next = self._start + self.interval

    def add(self, count: int, extra: str = "") -> None:
        """``count`` more done; ``extra`` (e.g. "3 shard(s)") is said with them."""
        self.done += count
        now = time.perf_counter()
        if self.enabled and now >= self._next:
            self._next = now + self.interval
            self._say(now, extra)

    def close(self, extra: str = "") -> None:
        """The closing line (everything done, in how long), after a job long enough to
        have said a line before: a short one stays quiet."""
        now = time.perf_counter()
        if self.enabled and (self._said or now - self._start >= self.interval):
            self._say(now, extra, closing=True)

    def _say(self, now: float, extra: str, closing: bool = False) -> None:
        elapsed = max(now - self._start, 1e-9)
        text = f"{self.what}: {self.done:,}"
        if self.total and not closing:
            text += f" of {self.total:,} {self.unit} ({100 * self.done / self.total:.0f}%)"
        else:
            text += f" {self.unit}"
        text += f"{', ' + extra if extra else ''}, {self.done / elapsed:,.0f} {self.unit}/s"
        if closing:
            text += f" in {elapsed:.1f} s"
        self._said = True
        if self.stream is not None:
            self.stream.write(f"sailfin: {text}\n")
            self.stream.flush()
        else:
            say(text)
