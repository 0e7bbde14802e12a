"""sailfin's own log messages (notices, restarts, thread counts) go to stderr.

Metrics go through writers; this is for what a person reading the job's
output should know. Rank 0 shows notices; other ranks show only warnings.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("sailfin")


def configure_logging(rank: int = 0) -> None:
    """Give the ``sailfin`` logger a stderr handler unless the application set one up."""
    if log.handlers or logging.getLogger().handlers:
        return  # the application decides where messages go
    handler = logging.StreamHandler(sys.stderr)
    prefix = "sailfin" if rank == 0 else f"sailfin[rank {rank}]"
    handler.setFormatter(logging.Formatter(f"{prefix}: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False
