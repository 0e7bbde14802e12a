"""``<output_dir>/time_account.json``: where a run's wall time went, kept across restarts.
Storage only (replaced whole, atomically); what the numbers mean is
:mod:`sailfin.trainer.features.time_account`.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

from ..utils.files import replace_file

ACCOUNT_FILE = "time_account.json"
VERSION = 1

# The components of a segment's seconds, in the order charts and tables show them (a
# restart's gap and start-up come first in time).
COMPONENTS = ("restart_gap", "startup", "productive", "replayed", "data_wait", "checkpoint",
              "snapshot", "validation", "oom_retries", "other")


def account_path(output_dir: str) -> str:
    return os.path.join(output_dir, ACCOUNT_FILE)


def read_account(path: str) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """The account at ``path`` and None, or (None, why it cannot be used); a missing file
    is (None, None): a run that starts here for the first time."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as exc:
        return None, f"{path} is unreadable ({exc})"
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(
            data.get("segments"), list):
        return None, f"{path} is not a version-{VERSION} sailfin time account"
    return data, None


def write_account(path: str, account: dict[str, Any], durable: bool = False) -> None:
    """Replace the file atomically (``durable``: also survives a power cut)."""
    data = (json.dumps(account, separators=(",", ":")) + "\n").encode("utf-8")
    replace_file(path, data, durable)


def set_summary_field(path: str, key: str, value: Any) -> None:
    """Set ``key`` in the JSON file ``path`` (summary.json) and replace it atomically:
    the final time account is known only after the summary was first written."""
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    data[key] = value
    replace_file(path, (json.dumps(data, indent=2) + "\n").encode("utf-8"))


def run_start_time() -> float:
    """Where a run's start-up began, in seconds since the epoch (``time.time()``'s clock):
    the process start for the first run of a process (a torchrun restart is a new
    process), now for a later one (a second Trainer in a notebook)."""
    global _CLAIMED
    if _CLAIMED:
        return time.time()
    _CLAIMED = True
    if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        # torchrun's first round: the job started with the launcher, this process's parent
        # (a later round's launcher time is the restart gap's).
        return min(process_start_time(), process_start_time(os.getppid()))
    return process_start_time()


def account_totals(account: dict[str, Any]) -> dict[str, Any]:
    """The account summed over its segments: wall, each component, goodput."""
    seconds = dict.fromkeys(COMPONENTS, 0.0)
    segments = account.get("segments", [])
    for seg in segments:
        for key, value in seg["seconds"].items():
            seconds[key] = seconds.get(key, 0.0) + value
    wall = sum(seconds.values())
    return {
        "wall_seconds": round(wall, 4),
        "goodput": round(seconds["productive"] / wall, 4) if wall > 0 else None,
        "seconds": {k: round(v, 4) for k, v in seconds.items()},
        "segments": len(segments),
        "failures": sum(1 for s in segments if s.get("failure")),
        "replayed_estimated_seconds": round(sum(s.get("replayed_estimated", 0.0)
                                                for s in segments), 4),
        "idle_seconds": round(sum(s.get("idle_before", 0.0) for s in segments), 4),
    }


def process_start_time(pid: Optional[int] = None) -> float:
    """When this process (or ``pid``) started, in seconds since the epoch. Linux tells it
    (``/proc``); elsewhere the first import of this module (at the latest when a trainer
    is set up) stands in for it, and start-up reads shorter."""
    try:
        with open(f"/proc/{pid or 'self'}/stat", encoding="ascii") as fh:
            # Field 22 (after the command name, which may hold spaces): start in clock ticks.
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)  # the ticks' origin
        started = boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED if pid is None else time.time()
    return started if pid is not None else min(started, _IMPORTED)  # not after the import


_IMPORTED = time.time()
_CLAIMED = False
