"""``sailfin train CONFIG.yaml [--section.key value ...]``: parse, build, fit, close."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import yaml

from . import after_cli, shard_cli
from .config import ConfigError, load_config
from .distributed.exit_codes import NOTHING_TO_TRAIN_EXIT_CODE
from .distributed.launch_notes import FINISHED, USER_ERROR, leave_note, noted_by_others
from .logging.writers import WriterError
from .signals import (PREEMPTED_EXIT_CODE, StoppedDuringSetup, default_signals,
                      note_preempted, raise_swallowed_stop, setup_over, stop_at_start,
                      stop_during_setup)
from .utils.voice import line


def _parser() -> argparse.ArgumentParser:
    from .config.help import trainer_keys_help
    from .version import __version__

    parser = argparse.ArgumentParser(prog="sailfin", description="sailfin training library")
    parser.add_argument("--version", action="version", version=f"sailfin {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a recipe from a YAML config",
                           description="Train a recipe. Overrides: --trainer.epochs 3, "
                                       "--trainer.backend=sp, --module.init_args.lr 0.1",
                           formatter_class=argparse.RawDescriptionHelpFormatter)

    def train_help() -> str:
        # Read from the schema's source only when the help is printed (a third of a
        # second that every `sailfin train` paid).
        train.epilog = ("config keys (key  type = default  doc); set them in the YAML's "
                        "trainer: section or as --key value:\n" + trainer_keys_help())
        return argparse.ArgumentParser.format_help(train)

    train.format_help = train_help
    train.add_argument("config", help="the run's YAML config")
    train.add_argument("--print-config", action="store_true",
                       help="print the resolved config and exit")
    report = sub.add_parser("report", help="charts and a summary of a run's metrics",
                            description="PNG charts (loss, validation metrics, lr, "
                                        "throughput vs step) and report.md from "
                                        "OUTPUT_DIR/metrics.jsonl")
    report.add_argument("output_dir", help="a run's trainer.output_dir")
    report.add_argument("--compare", nargs="+", default=[], metavar="DIR",
                        help="overlay these runs' output directories")
    report.add_argument("--out", help="where to write (default: OUTPUT_DIR/report)")
    report.add_argument("--dpi", type=int, default=100, help="PNG resolution")
    clean = sub.add_parser("clean", help="remove a run's memory snapshots from this machine",
                           description="Remove the memory snapshots (trainer.checkpoint."
                                       "memory) a run left in shared memory on this machine; "
                                       "its checkpoints and outputs stay")
    clean.add_argument("output_dir", help="the run's trainer.output_dir")
    export = sub.add_parser("export", help="a save_pretrained (or PEFT adapter) directory "
                            "from a sailfin.hf run's checkpoint",
                            description="Build the recipe a checkpoint records, load its "
                                        "weights (any backend's) and write OUT as final/hf "
                                        "would be: see docs/hf.md")
    export.add_argument("checkpoint", help="a checkpoint directory, or a run's checkpoints/ "
                                           "(its latest)")
    export.add_argument("out", help="the directory to write")
    shard_cli.add_parser(sub)
    after_cli.add_parsers(sub)  # evaluate, predict
    sub.add_parser("launch", add_help=False,  # its own help: sailfin.launch.HELP
                   help="torchrun with the same arguments, a closing line and exit codes "
                        "a scheduler can read (75: preempted, requeue)")
    # sailfin launch: these may stand where torchrun takes a script (launch train CONFIG)
    parser.set_defaults(sailfin_commands=tuple(n for n in sub.choices if n != "launch"))
    return parser


def train_command(config: str, overrides: Sequence[str], print_config: bool,
                  own_process: bool = False) -> int:
    # class_path names resolve from the working directory, as with `python -m`.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    cfg = load_config(config, overrides)
    if print_config:
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return 0
    from .checkpoint import CheckpointError
    from .checkpoint.errors import CheckpointWriteError
    from .trainer import Trainer
    from .trainer.safety.preemption import PREEMPTED_EXIT_CODE, TrainingPreempted

    try:
        module = cfg.build(_module_builder(cfg.trainer))
        # The context manager leaves the process group on every path.
        with Trainer(module, cfg.trainer, hparams=cfg.to_dict(),
                     callbacks=[_setup_over_callback()]) as trainer:
            trainer.end_process_on_hang = own_process  # in-process: HangDetected instead
            try:
                summary = trainer.train()
                leave_note(FINISHED)  # sailfin launch: a stop from now on loses nothing
            except StoppedDuringSetup as exc:
                if not exc.after_start:
                    raise  # before training began: set-up indeed
                # The loop had run (and failed, or was ending) when a SIGTERM (torchrun
                # stopping the job after a worker died) came: say what was lost.
                raise StoppedDuringSetup(exc.signal_name, True, _stopped_after_start(
                    trainer, exc)) from exc.__context__
            except TrainingPreempted:
                note_preempted()  # saved: before the teardown, which torchrun may cut short
                raise
            finally:
                setup_over()  # a SIGTERM from now on (torchrun stopping us) is not set-up
    except CheckpointError as exc:
        # A save that failed on this rank alone (its disk, its files) is said here: the
        # rank that would print it (rank 0) may be stopped by torchrun first.
        cause = exc.__cause__
        if _staging_removed_under_us(cause):
            # Another rank's save failed and it removed the shared partial save while this
            # rank still wrote into it: that rank prints the error; this one is its echo.
            line(f"sailfin: rank {os.environ.get('RANK', '?')} stopped: the partial save it "
                 f"was writing ({cause.file}) was removed, as a rank whose save failed does; "
                 "that rank printed why")
            return 1
        alone = (isinstance(cause, (OSError, CheckpointWriteError))
                 and not getattr(cause, "every_rank", False))
        _user_error(f"sailfin: checkpoint error: {exc}", here=alone)
        return 2
    except TrainingPreempted as exc:  # SIGTERM / first Ctrl-C: saved, writers closed
        if trainer.dist.is_main:
            line(f"sailfin: {exc} (exit code {PREEMPTED_EXIT_CODE})")
        return PREEMPTED_EXIT_CODE
    if summary.get("nothing_trained"):  # the trainer said so (rank 0); not a success
        return NOTHING_TO_TRAIN_EXIT_CODE
    if not trainer.dist.is_main:
        return 0
    account = summary.get("time_account") or {}
    goodput = (f"; goodput {100 * account['goodput']:.1f}% of {account['wall_seconds']:.1f} s "
               f"wall" if account.get("goodput") is not None else "")  # docs/goodput.md
    print(f"done: {summary['global_step']} steps, {summary['samples_seen']} samples in "
          f"{summary['train_seconds']:.1f} s{goodput}; outputs in {cfg.trainer.output_dir}")
    for name, value in _flatten(summary["val"]).items():
        print(f"validation {name}: {value:.4f}" if isinstance(value, float)
              else f"validation {name}: {value}")
    return 0


def _setup_over_callback():
    from .trainer.core.callbacks import Callback

    class SetupOver(Callback):
        """Training begins: a signal from now on is the loop's, not set-up's."""

        def on_train_start(self, trainer) -> None:
            raise_swallowed_stop()  # not a step after a stop that set-up code swallowed
            setup_over()

    return SetupOver()


def _stopped_after_start(trainer, exc: StoppedDuringSetup) -> str:
    """What a SIGTERM that came after the loop began ended: the step reached, the error
    the run was stopping on, and the steps past the last checkpoint."""
    step = trainer.global_step
    cause = exc.__context__
    why = ""
    if cause is not None and not isinstance(cause, StoppedDuringSetup):
        first = (str(cause).strip().splitlines() or [""])[0][:200]
        why = f", while stopping after {type(cause).__name__}" + (f": {first}" if first else "")
    try:
        latest = trainer.checkpointer.latest()
    except Exception:  # the checkpoint store may be what failed: say what is known
        latest = None
    saved = int(latest.rsplit("-", 1)[1]) if latest and latest.rsplit("-", 1)[-1].isdigit() \
        else None
    if saved is None:
        lost = (f"no checkpoint was saved: the {step} step(s) trained are lost; run the same "
                "command again to start over")
    elif step > saved:
        lost = (f"the {step - saved} step(s) after the last checkpoint ({latest}) are lost; "
                "run the same command again to resume from it")
    else:
        lost = f"nothing past the last checkpoint ({latest}) was lost; run the same command " \
               "again to resume from it"
    return f"stopped by {exc.signal_name} at step {step}{why}; {lost}"


def _staging_removed_under_us(cause: Optional[BaseException]) -> bool:
    """A local checkpoint file this rank could not write because its directory (the save's
    partial, shared with the other ranks) no longer exists."""
    import errno

    from .checkpoint.errors import CheckpointWriteError

    if not isinstance(cause, CheckpointWriteError) or cause.errno != errno.ENOENT:
        return False
    parent = os.path.dirname(cause.file)
    return bool(parent) and os.path.isabs(parent) and not os.path.exists(parent)


def _module_builder(trainer):
    """Under the fsdp backends rank 0 builds the recipe as sp does and the other ranks on
    the meta device (trainer.fsdp.build): no rank but 0 ever holds the whole model."""
    from .backends import ALIASES

    if ALIASES.get(trainer.backend, ("", ""))[0] != "fsdp":
        return None
    from .backends.fsdp_build import sharded_build
    from .distributed import DistEnv

    rank = DistEnv.from_config(trainer.distributed).rank

    def build(cls, **kwargs):
        with sharded_build(rank, trainer.fsdp.build):
            return cls(**kwargs)
    return build


def _user_error(message: str, here: bool = False) -> None:
    """A user error, printed once: by rank 0 (every rank under torchrun hits the same),
    or ``here``, by the rank that alone met it."""
    try:
        from .distributed import DistEnv
        rank = DistEnv.from_environ().rank
    except Exception:  # a launcher's variables that do not add up: say it here anyway
        rank = 0
    if rank == 0 or here:
        line(message)
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        _leave_it_to_rank_0(message, rank)


def _leave_it_to_rank_0(message: str, rank: int, grace_s: float = 20.0) -> None:
    """Under torchrun, a rank that exits first has the agent stop rank 0 before it prints
    the error they share: wait for rank 0 to print it and exit (the agent then stops
    this rank, quietly); if it has not in ``grace_s``, this rank says it."""
    import signal
    import time

    def stopped(*_):
        raise SystemExit(2)

    signal.signal(signal.SIGTERM, stopped)
    time.sleep(grace_s)
    line(f"sailfin[rank {rank}]: {message.removeprefix('sailfin: ')}")


def _user_error_code(exc: BaseException) -> Optional[int]:
    """The one table from an error the user can fix to its line and exit code (2), or
    None for any other error. ``here``: the error is this rank's own finding (a damaged
    shard it read), so every rank says it; otherwise every rank meets the same one and
    rank 0 says it."""
    from .data.shards.errors import ShardError
    from .interfaces import RecipeError
    from .trainer.safety.run_lock import RunLockError

    table = ((ConfigError, "config error: ", False),
             (RecipeError, "recipe error: ", False),  # unusable, seen before step 1
             (WriterError, "", False),  # a writer cannot write where the config says
             (RunLockError, "", False),
             (ShardError, "shard error: ", True))
    for kind, prefix, here in table:
        if isinstance(exc, kind):
            _user_error(f"sailfin: {prefix}{_without_worker_traceback(exc)}", here=here)
            return 2
    return None


def _without_worker_traceback(exc: BaseException) -> str:
    """A DataLoader worker's error arrives with the worker's traceback in its message
    ("Caught ShardError in DataLoader worker process 0. Original Traceback ..."): keep
    the error's own message, its last line."""
    text = str(exc)
    if "Original Traceback" not in text:
        return text
    last = text.rstrip().splitlines()[-1]
    return last.split(": ", 1)[1] if ": " in last else last


def _flatten(metrics: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}/"))
        else:
            out[prefix + key] = value
    return out


def _recorded(fn):
    """Under torchrun, a worker's exception is written where the agent reports it."""
    if "TORCHELASTIC_ERROR_FILE" not in os.environ:
        return fn
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(fn)


def _user_errors(fn):
    """``fn`` with the errors a user can fix turned into one line and exit 2."""
    def run(*args):
        try:
            return fn(*args)
        except Exception as exc:
            code = _user_error_code(exc)
            if code is not None:
                return code
            # Under sailfin launch: a collective broken because another rank stopped on a
            # user error it printed is no failure of this rank's (no traceback).
            others = noted_by_others(USER_ERROR)
            if not others:
                raise
            line(f"sailfin: rank {os.environ.get('RANK', '?')} stopped ({type(exc).__name__}) "
                 f"because rank {', '.join(map(str, others))} stopped on the error it "
                 "printed")
            return 1
    return run


def command() -> int:
    """The ``sailfin`` command (also ``python -m sailfin``): :func:`main` in a process of
    its own, which alone may end the process on a stuck set-up or a hang (75). A stop
    before a command takes the signals over is one line and 75."""
    stop_at_start()
    try:
        return main(own_process=True)
    except StoppedDuringSetup as exc:
        print(f"sailfin: {exc} (exit code {PREEMPTED_EXIT_CODE})", file=sys.stderr)
        return PREEMPTED_EXIT_CODE


def main(argv: Optional[Sequence[str]] = None, own_process: bool = False) -> int:
    """Run one sailfin command; return its exit code. In-process (``own_process`` False:
    a test, a notebook) it never ends the process and leaves its signal handlers as it
    found them: ``--help``, ``--version`` and a usage error return their code too."""
    try:
        return _main(argv, own_process)
    except SystemExit as exc:  # argparse's (and torchrun's parser's) way to end
        return _exit_code(exc)


def _exit_code(exc: SystemExit) -> int:
    """The code ``sys.exit`` would give the process for ``exc``."""
    if exc.code is None or isinstance(exc.code, int):
        return int(exc.code or 0)
    print(exc.code, file=sys.stderr)  # sys.exit("message"): printed, exit 1
    return 1


def _main(argv: Optional[Sequence[str]], own_process: bool) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if own_process:
        raise_swallowed_stop()  # a stop while it started, that code there swallowed
    if own_process and args.command not in ("train", "launch"):
        default_signals()  # these handle no stop of their own: Ctrl-C is Python's
    if rest and args.command in ("report", "export", "clean"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "report":
        from .report import report_command
        return report_command(args.output_dir, args.compare, args.out, args.dpi)
    if args.command == "launch":
        from .launch import launch_command
        return launch_command(list(argv if argv is not None else sys.argv[1:])[1:],
                              args.sailfin_commands)
    if args.command == "export":
        from .hf.export import export_command
        path = export_command(args.checkpoint, args.out)
        if path is None:
            return 2
        print(f"exported {args.checkpoint} to {path}")  # the command's result
        return 0
    if args.command == "clean":  # the command's result
        from .checkpoint.snapshot_dirs import clean
        removed = clean(args.output_dir)
        print("".join(f"removed {p}\n" for p in removed) + f"sailfin clean: {len(removed)} memory "
              f"snapshot director{'y' if len(removed) == 1 else 'ies'} of {args.output_dir} removed")
        return 0
    try:
        if args.command == "train":
            # User errors end inside the recorded call: torchrun reports no traceback.
            with stop_during_setup(end_stuck=own_process):  # until the trainer has SIGTERM
                code = _recorded(_user_errors(train_command))(args.config, rest,
                                                              args.print_config, own_process)
                # sailfin launch: this rank's own end, not torchrun's stop
                if code in (2, NOTHING_TO_TRAIN_EXIT_CODE):
                    leave_note(USER_ERROR)
                return code
        if args.command in ("evaluate", "predict"):
            return _recorded(_user_errors(after_cli.run))(args, rest, _module_builder)
        return _user_errors(shard_cli.run)(args, rest)
    except KeyboardInterrupt:  # a second Ctrl-C (the first one saves and stops)
        if args.command != "train":
            raise
        line("sailfin: aborted by a second Ctrl-C; steps since the last checkpoint are "
             "lost, the checkpoints already saved are intact")
        return 130
    except StoppedDuringSetup as exc:
        note_preempted()
        line(f"sailfin: {exc} (exit code {PREEMPTED_EXIT_CODE})")
        return PREEMPTED_EXIT_CODE
