"""``sailfin launch``: torchrun with the same arguments, and an exit code a scheduler can read.

Under plain ``torchrun`` a preempted job exits 1 whatever its workers did: each
worker saves and exits 75, and torchrun reports ``ChildFailedError``; a SIGTERM
to torchrun itself becomes ``SignalException``. ``sailfin launch`` runs the
same launcher (``torch.distributed.run``'s parser and ``run``) and exits:

- 75 when every worker that failed exited 75 (it saved and stopped on a
  signal; one the agent stopped with SIGTERM after its save counts too), or when the launcher got SIGTERM and every local worker it then
  stopped saved and exited 75: a Kubernetes ``podFailurePolicy`` or a Slurm
  requeue can tell a preemption from a failure;
- the workers' code when they all failed with the same one (2: a user error);
- 1 for any other failure, 128 + the signal when stopped by a signal without
  a save; 0 when the run finished.

Each worker leaves a note in a directory the launcher names in
``SAILFIN_LAUNCH_DIR`` when it stops with a checkpoint (see
:func:`sailfin.signals.note_preempted`); the launcher counts them.

Example::

    sailfin launch --nnodes=1 --nproc-per-node=2 -m sailfin train config.yaml
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from typing import Sequence

from .signals import LAUNCH_DIR_ENV, PREEMPTED_EXIT_CODE


def launch_command(argv: Sequence[str]) -> int:
    """Run torchrun with ``argv``; return the exit code described above."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import determine_local_world_size, parse_args, run

    args = parse_args(list(argv))
    notes = tempfile.mkdtemp(prefix="sailfin-launch-")
    previous = os.environ.get(LAUNCH_DIR_ENV)
    os.environ[LAUNCH_DIR_ENV] = notes  # the workers inherit it
    try:
        run(args)
        return 0
    except ChildFailedError as exc:
        codes = {failure.exitcode for failure in exc.failures.values()}
        if _all_preempted(exc.failures, notes):
            print(f"sailfin launch: every stopped worker saved a checkpoint and exited "
                  f"{PREEMPTED_EXIT_CODE} (preempted); run the same command again to resume "
                  f"(exit code {PREEMPTED_EXIT_CODE})", file=sys.stderr, flush=True)
            return PREEMPTED_EXIT_CODE
        print(exc.format_msg(), file=sys.stderr, flush=True)
        code = codes.pop() if len(codes) == 1 else 1
        return code if 0 < code < 128 else 1
    except SignalException as exc:
        local = determine_local_world_size(args.nproc_per_node)
        saved = len([n for n in os.listdir(notes) if n.startswith("preempted-")])
        if saved >= local:
            print(f"sailfin launch: stopped by {exc.sigval.name}; all {local} worker(s) saved "
                  f"a checkpoint and exited {PREEMPTED_EXIT_CODE}; run the same command again "
                  f"to resume (exit code {PREEMPTED_EXIT_CODE})", file=sys.stderr, flush=True)
            return PREEMPTED_EXIT_CODE
        print(f"sailfin launch: stopped by {exc.sigval.name}; {saved} of {local} worker(s) "
              "saved a checkpoint before they stopped", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    finally:
        if previous is None:
            os.environ.pop(LAUNCH_DIR_ENV, None)
        else:
            os.environ[LAUNCH_DIR_ENV] = previous
        shutil.rmtree(notes, ignore_errors=True)


def _all_preempted(failures: dict, notes: str) -> bool:
    """Every failed worker exited 75, or was stopped by the agent (SIGTERM, once another
    worker had exited) after it had noted its preemption save."""
    saved = set(os.listdir(notes))
    codes = [failure.exitcode for failure in failures.values()]
    return PREEMPTED_EXIT_CODE in codes and all(
        failure.exitcode == PREEMPTED_EXIT_CODE
        or (failure.exitcode == -signal.SIGTERM and f"preempted-rank{rank}" in saved)
        for rank, failure in failures.items())
