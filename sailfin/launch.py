"""``sailfin launch``: torchrun with the same arguments, and an exit code a scheduler can read.

Under plain ``torchrun`` a preempted job exits 1 whatever its workers did (each worker
saves and exits 75; torchrun reports ``ChildFailedError``). ``sailfin launch`` runs the
same launcher (``torch.distributed.run``'s parser and ``run``) and reads the notes each
worker leaves in ``SAILFIN_LAUNCH_DIR`` (:mod:`sailfin.distributed.launch_notes`), so that
its closing line and exit code (:data:`HELP`, docs/robustness.md) say what happened, not
what the exit codes alone suggest.

Example::

    sailfin launch --nnodes=1 --nproc-per-node=2 -m sailfin train config.yaml
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import tempfile
from typing import Any, Optional, Sequence

from .distributed.exit_codes import (HANG_EXIT_CODE, NOTHING_TO_TRAIN_EXIT_CODE,
                                     PREEMPTED_EXIT_CODE)
from .distributed.launch_notes import (FINISHED, HANG, LAUNCH_DIR_ENV, PREEMPTED, TRAINING,
                                      USER_ERROR, read_notes)
from .signals import StoppedDuringSetup
from .utils.voice import line

HELP = f"""\
usage: sailfin launch [torchrun options] -m sailfin train CONFIG.yaml [--section.key value ...]

torchrun (torch.distributed.run) with the same options. What sailfin launch adds:

  a sailfin command where torchrun takes a script: sailfin launch [torchrun options]
  train CONFIG.yaml runs -m sailfin train CONFIG.yaml (unless a file named train exists);

  a closing line on stderr (sailfin launch: ...) that says how the job ended, read from
  the workers' notes (saved a checkpoint on a signal, printed a user error, stopped by the
  hang watchdog), not from exit codes alone;

  an exit code a scheduler can act on (plain torchrun exits 1 whatever happened):
    0    the run finished
    {PREEMPTED_EXIT_CODE:<4} preempted (SIGTERM, a first Ctrl-C) after a checkpoint, or the hang watchdog
         ended the job: requeue it, the same command resumes
    2    a worker printed a user error (the config, a checkpoint, a full disk)
    {NOTHING_TO_TRAIN_EXIT_CODE:<4} the output directory holds a finished run: nothing was trained
    1    any other failure (torchrun's report follows); 128+N: stopped by signal N while
         a worker that had begun training saved nothing

torchrun's own options: torchrun --help (or python -m torch.distributed.run --help).
Example: sailfin launch --nnodes=1 --nproc-per-node=2 -m sailfin train config.yaml
More: docs/multinode.md (Slurm, Kubernetes), docs/robustness.md (signals, exit codes).
"""


def wants_help(argv: Sequence[str]) -> bool:
    """``-h``/``--help`` among the launcher's own options (before ``-m`` or the script)."""
    for arg in argv:
        if arg in ("-m", "--module") or arg.endswith(".py"):
            return False
        if arg in ("-h", "--help"):
            return True
    return False


# Exit codes of a worker the agent stopped after another worker had exited.
_STOPPED_BY_AGENT = (-signal.SIGTERM, -signal.SIGKILL)


def launch_command(argv: Sequence[str], commands: Sequence[str] = ("train",)) -> int:
    """Run torchrun with ``argv`` (or print :data:`HELP`); return the exit code :data:`HELP`
    lists. ``commands``: sailfin's, which may stand where torchrun takes a script. A stop
    before torchrun's agent takes the signals over (while torch imports, during the
    rendezvous; :func:`sailfin.signals.stop_at_start`) is one line and 75."""
    if wants_help(argv):
        print(HELP, end="")
        return 0
    try:
        return _launch(argv, commands)
    except StoppedDuringSetup as exc:
        line(f"sailfin launch: stopped by {exc.signal_name} while starting, before any "
             "worker began: nothing was lost; run the same command again (exit code "
             f"{PREEMPTED_EXIT_CODE})")
        return PREEMPTED_EXIT_CODE


def sailfin_command(args: Any, argv: Sequence[str], commands: Sequence[str]) -> Optional[str]:
    """torchrun's parsed ``args`` with a sailfin command where the script goes
    (``sailfin launch --nproc-per-node 2 train config.yaml``) made ``-m sailfin train
    config.yaml``, in place; a config given as the script: the line that refuses it,
    showing the form that works."""
    script = args.training_script
    if args.module or args.no_python:
        return None
    runnable = os.path.isfile(script) or os.path.isfile(os.path.join(script, "__main__.py"))
    if script in commands and not runnable:  # a folder named train/ is no script
        args.module = True
        args.training_script = "sailfin"
        args.training_script_args = [script, *args.training_script_args]
    elif script.endswith((".yaml", ".yml")):
        at = max(i for i, arg in enumerate(argv) if arg == script)
        right = shlex.join(["sailfin", "launch", *argv[:at], "-m", "sailfin", "train",
                            *argv[at:]])
        return (f"sailfin launch: {script} is a config, not a script torchrun can run; name "
                f"the command before it: {right}")
    return None


def _launch(argv: Sequence[str], commands: Sequence[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import determine_local_world_size, parse_args, run

    args = parse_args(list(argv))
    refused = sailfin_command(args, argv, commands)
    if refused:
        line(refused)
        return 2
    notes = tempfile.mkdtemp(prefix="sailfin-launch-")
    previous = os.environ.get(LAUNCH_DIR_ENV)
    os.environ[LAUNCH_DIR_ENV] = notes  # the workers inherit it
    try:
        run(args)
        return 0
    except ChildFailedError as exc:
        codes = {rank: failure.exitcode for rank, failure in exc.failures.items()}
        closing, code = _closing_line(codes, read_notes(notes))
        line(exc.format_msg() if closing is None
             else f"sailfin launch: {closing} (exit code {code})")
        return code
    except SignalException as exc:
        local = determine_local_world_size(args.nproc_per_node)
        found = read_notes(notes)
        lost = sorted(found[TRAINING] - found[PREEMPTED] - found[FINISHED])
        saved = len(found[TRAINING] & found[PREEMPTED])
        if not lost:
            line(f"sailfin launch: stopped by {exc.sigval.name}; {saved} of {local} worker(s) "
                 "saved a checkpoint, the others had not begun training or had finished "
                 f"it: nothing was lost, run the same command again to resume (exit code "
                 f"{PREEMPTED_EXIT_CODE})")
            return PREEMPTED_EXIT_CODE
        line(f"sailfin launch: stopped by {exc.sigval.name}; rank(s) "
             f"{', '.join(map(str, lost))} had begun training and stopped without saving a "
             "checkpoint: their steps since the last checkpoint are lost (exit code "
             f"{128 + int(exc.sigval)})")
        return 128 + int(exc.sigval)
    finally:
        if previous is None:
            os.environ.pop(LAUNCH_DIR_ENV, None)
        else:
            os.environ[LAUNCH_DIR_ENV] = previous
        shutil.rmtree(notes, ignore_errors=True)


def _closing_line(codes: dict[int, int], notes: dict[str, set[int]]
                  ) -> tuple[Optional[str], int]:
    """What the failed workers' codes and notes say happened, and the launcher's code;
    (None, code) for a failure torchrun's own report describes best."""
    if notes[USER_ERROR]:  # the others' ends (SIGTERM, a broken collective) follow from it
        ranks = sorted(notes[USER_ERROR])
        who = (f"rank {ranks[0]} stopped on the error it printed above" if len(ranks) == 1
               else f"ranks {', '.join(map(str, ranks))} stopped on the error printed above")
        finished = NOTHING_TO_TRAIN_EXIT_CODE in codes.values() and all(
            c == NOTHING_TO_TRAIN_EXIT_CODE or c in _STOPPED_BY_AGENT for c in codes.values())
        return f"{who}; torchrun stopped any other worker", (
            NOTHING_TO_TRAIN_EXIT_CODE if finished else 2)
    if notes[HANG] and all(c == HANG_EXIT_CODE or c in _STOPPED_BY_AGENT
                           for c in codes.values()):
        return ("the hang watchdog ended the job: a rank stopped making progress (its report "
                "above names it and the stacks are in <output_dir>/hang/); no checkpoint was "
                "saved by the stop: run the same command again to resume from the last one",
                HANG_EXIT_CODE)
    stopped = notes[PREEMPTED]
    if any(c == PREEMPTED_EXIT_CODE for c in codes.values()) and all(
            (c == PREEMPTED_EXIT_CODE or c in _STOPPED_BY_AGENT) and rank in stopped
            for rank, c in codes.items()):
        saved = len(stopped & notes[TRAINING])
        return (f"every stopped worker exited {PREEMPTED_EXIT_CODE} (preempted): {saved} "
                "saved a checkpoint, the others had not begun training; run the same command "
                "again to resume", PREEMPTED_EXIT_CODE)
    distinct = set(codes.values())
    code = distinct.pop() if len(distinct) == 1 else 1
    return None, code if 0 < code < 128 else 1
