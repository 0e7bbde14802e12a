"""Starting the hang watchdog for a run (the composition root): as soon as its process
group exists.

Set-up has collectives of its own (the model's broadcast, the resume's agreement,
the start-up checks' batches), and a rank stopped there leaves the others waiting
as surely as one stopped in a step; so the watchdog starts right after the backend
joined the group, in phase ``starting``, and the trainer stops it after the last
step (see :mod:`sailfin.distributed.watchdog`).

Example::

    trainer.backend.setup(trainer.module)
    start_watchdog(trainer, in_setup=True)  # trainer.watchdog: None when it is off
"""

from __future__ import annotations

import os
from typing import Any

from ...distributed.watchdog import DATA, build_watchdog


def ends_process_on_hang(trainer: Any) -> bool:
    """Whether a hang ends this process (exit 75) or raises ``HangDetected`` in it:
    ``trainer.end_process_on_hang`` when set (the sailfin command sets True), else True
    only in a worker torchrun started (it restarts the job); a notebook or test that
    trains in-process is never ended by the library."""
    chosen = getattr(trainer, "end_process_on_hang", None)
    return bool(chosen) if chosen is not None else "TORCHELASTIC_RUN_ID" in os.environ


def start_watchdog(trainer: Any, in_setup: bool = False) -> None:
    """Start ``trainer.watchdog`` as ``trainer.distributed.hang_seconds`` asks (once).

    ``in_setup``: called as the group is joined; a single process has no partner to
    wait for in set-up, so its watchdog starts with the first step instead. Called again
    as training begins, it publishes the rank's record at once."""
    if getattr(trainer, "watchdog", None) is None and not (
            in_setup and trainer.dist.world_size == 1):
        args = trainer.args
        trainer.watchdog = build_watchdog(
            args.distributed.hang_seconds, trainer.dist.rank, trainer.dist.world_size,
            trainer.backend.group_store(), trainer.heartbeat,
            os.path.join(args.output_dir, "hang"), args.distributed.hang_seconds_slow_phases,
            end=ends_process_on_hang(trainer))
    if not in_setup and trainer.watchdog is not None:
        # Training begins: said now, not at the thread's next tick, so that a rank stopped
        # in its first second is reported in its first step.
        trainer.heartbeat.phase = DATA
        trainer.watchdog.publish_now()
