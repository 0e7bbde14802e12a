"""How much of training waits for data, measured without touching the step.

The loop already writes its phase into the :class:`~sailfin.distributed.watchdog.Heartbeat`
(``data loading`` while it waits in ``next(batches)``). A background thread
reads that attribute every ``interval`` seconds and counts; the share of
readings in the data phase, times the training time, is the data wait. The
step itself runs no extra instruction; the thread takes the GIL for a few
microseconds 50 times a second. It is a sample: over a run of minutes the
share is good to a fraction of a percent, over a few seconds it is rough.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional

from ...distributed.watchdog import DATA


class PhaseSampler:
    """Counts readings of ``heartbeat.phase`` until :meth:`stop`.

    Example::

        sampler = PhaseSampler(trainer.heartbeat)
        sampler.start()
        ...                                   # training
        sampler.stop()
        sampler.share(DATA)                   # 0.07: 7 % of the readings were data waits
    """

    def __init__(self, heartbeat: Any, interval: float = 0.02) -> None:
        self.heartbeat, self.interval = heartbeat, interval
        self.readings = 0
        self.data_readings = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        if self._thread is not None:
            return
        # The thread holds the sampler weakly: a trainer that failed and was dropped
        # without stop() does not keep a thread alive.
        self._thread = threading.Thread(target=_sample, args=(weakref.ref(self), self._stop,
                                                              self.interval),
                                        name="sailfin-phase-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def data_share(self) -> float:
        """The share of readings taken while the loop waited for data."""
        return self.data_readings / self.readings if self.readings else 0.0

    def _read(self) -> None:
        self.readings += 1
        if self.heartbeat.phase == DATA:
            self.data_readings += 1

    def __del__(self) -> None:
        self._stop.set()


def _sample(ref: "weakref.ref[PhaseSampler]", stop: threading.Event, interval: float) -> None:
    while not stop.wait(interval):
        sampler = ref()
        if sampler is None:
            return
        sampler._read()
        del sampler
