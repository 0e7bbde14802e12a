"""What :meth:`Trainer.setup` builds, in order: the batch plan and loaders, the
optimizers, the checkpointer and the callbacks behind each feature (:func:`build_run`,
which returns them as a :class:`~sailfin.trainer.core.run.Run`); then the resume and
the writers (:func:`start_run`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ...checkpoint import build_checkpointer
from ...data.plan import BatchPlan
from ...distributed.watchdog import DATA, build_watchdog
from ...interfaces import ModuleInterface, RecipeError
from ...utils.seed import seed_everything
from ...utils.voice import say
from ..checkpointing.accepted import FreshHyperparameters, apply_accepted
from ..checkpointing.memory_snapshots import memory_snapshot_callback
from ..checkpointing.resume import continue_log, resume
from ..checkpointing.saver import checkpoint_callback, checkpoint_callbacks
from ..features.autobatch import AutoMicroBatch
from ..features.loop_features import build_loop_features, build_observers
from ..features.run_stats import RunStats
from ..features.time_account import TimeAccount
from ..safety.nonfinite import NonFiniteGuard
from ..safety.startup_checks import nothing_to_train
from ..core.callbacks import Callback
from ..core.run import Run
from ..core.loaders import build_train_loader, build_val_loaders, dataset_set_epoch
from ..core.pymarlin_forms import train_step_end_caller, val_epoch_end_caller
from .threads import fix_math_threads

if TYPE_CHECKING:
    from .trainer import Trainer

# The callbacks in the order the loop calls them, by the piece that gives them; each
# piece's place and why. ``build_run`` fills them (in_order); nothing else orders them.
CALLBACK_ORDER = (
    "given",             # Trainer(callbacks=...), then the recipe's configure_callbacks()
    "features",          # EMA, step validation, early stopping: before the saver, which
    #                      saves their state
    "run_stats",         # the best metric so far: stateful, so before the saver too
    "saver",             # the checkpoints (trainer.checkpoint)
    "memory_snapshots",  # trainer.checkpoint.memory: after every stateful piece
    "autobatch",         # micro_batch_size auto: its size is kept in checkpoints
    "last_features",     # the first step's FLOPs
    "time_account",      # after the savers (their final save is counted), before progress
    "observers",         # writers, progress (its end line), profiler
)


def in_order(pieces: Mapping[str, Sequence[Callback]]) -> list[Callback]:
    """The callbacks of ``pieces`` (name in :data:`CALLBACK_ORDER` -> its callbacks) in
    the loop's order."""
    unknown = sorted(set(pieces) - set(CALLBACK_ORDER))
    if unknown:
        raise ValueError(f"no place in CALLBACK_ORDER for {unknown}")
    return [callback for name in CALLBACK_ORDER for callback in pieces.get(name, ())]


def build_run(trainer: "Trainer") -> Run:
    """Every piece of ``trainer``'s run, built from its config (called once, by
    :meth:`Trainer.setup`, which attaches them, then calls :func:`start_run`)."""
    args, dist, module, backend = trainer.args, trainer.dist, trainer.module, trainer.backend
    seed_everything(args.seed + dist.rank)  # per-rank streams (dropout) differ
    # micro_batch_size: auto searches from the largest size, up to PyMarlin's
    # gpu_batch_size_limit if given (see autobatch.py).
    autobatch = (AutoMicroBatch(args.train_batch_size, dist.world_size,
                                args.gpu_batch_size_limit, dist.rank)
                 if args.micro_batch_size == "auto" else None)
    size = args.micro_batch_size if autobatch is None else autobatch.size
    plan = BatchPlan.create(args.train_batch_size, size, dist.world_size, args.drop_last,
                            args.max_train_steps_per_epoch,
                            micro_batch_limit=args.gpu_batch_size_limit,
                            note=say if dist.is_main else None)
    backend.setup(module)  # ddp/fsdp on the CPU: their thread count
    fix_math_threads(backend.device, dist.is_main)  # one count for the whole run (threads.py)
    start_watchdog(trainer, in_setup=True)  # from the first collective: resume, checks
    plan = backend.batch_plan(plan)  # dp: unweighted, Poisson steps
    train_loader, train_sampler = build_train_loader(module, plan, dist, args)
    steps_per_epoch = plan.steps_in_epoch(train_sampler.num_samples)
    optimizers, schedulers = module.get_optimizers_schedulers(steps_per_epoch, args.epochs)
    optimizers, schedulers = as_list(optimizers), as_list(schedulers)
    if not optimizers:
        raise RecipeError("get_optimizers_schedulers returned no optimizer: return "
                          "([optimizer, ...], [scheduler, ...]) (the schedulers may be [])")
    # dp: clipping, noise and accounting around the optimizers (a no-op otherwise).
    backend.attach_optimizers(optimizers, train_sampler.num_samples, steps_per_epoch)
    checkpointer = build_checkpointer(args, dist, backend.barrier)
    saver = checkpoint_callback(checkpointer, args.checkpoint)
    run_stats = RunStats(args.checkpoint.best_metric, args.checkpoint.best_mode)
    features = build_loop_features(module, args, backend, dist)
    memory = memory_snapshot_callback(checkpointer, args, saver, module)
    # The time account reads how far a killed run logged before resuming trims metrics.jsonl.
    account = TimeAccount(args.output_dir, dist.is_main, args.resume != "never")
    callbacks = in_order({
        "given": trainer.callbacks,
        "features": features.callbacks,
        "run_stats": [run_stats],
        "saver": checkpoint_callbacks(saver),
        "memory_snapshots": memory,
        "autobatch": [autobatch] if autobatch is not None else [],
        "last_features": features.last_callbacks,
        "time_account": [account],
    })  # the observers follow, once the resume is done (start_run)
    end_train_step = train_step_end_caller(module)
    for snapshots in memory:  # a snapshot's write is waited for before its step's log
        end_train_step = snapshots.before_log(trainer, end_train_step)
    return Run(
        plan=plan, device=backend.device, train_loader=train_loader,
        train_sampler=train_sampler, num_train_samples=train_sampler.num_samples,
        steps_per_epoch=steps_per_epoch,
        val_loaders=build_val_loaders(module, args.val_batch_size or plan.micro_batch, dist),
        optimizers=optimizers, schedulers=schedulers,
        trainable_params=[p for p in module.parameters() if p.requires_grad],
        nonfinite=NonFiniteGuard(args.on_nonfinite, backend.device, dist.world_size,
                                 backend.all_reduce_mean,
                                 getattr(train_sampler, "step_indices", None)),
        callbacks=callbacks, checkpointer=checkpointer, saver=saver, run_stats=run_stats,
        ema=features.ema, flops=features.flops, autobatch=autobatch,
        end_backward_hook=(None if type(module).on_end_backward is ModuleInterface.on_end_backward
                           else module.on_end_backward),
        end_train_step_hook=end_train_step,
        end_val_epoch_hook=val_epoch_end_caller(module),
        dataset_epoch_hook=dataset_set_epoch(train_loader))


def as_list(value: Any) -> list:
    """None -> [], a list or tuple -> a list, one object -> a list of it."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def start_run(trainer: "Trainer") -> None:
    """Put ``trainer``'s run (attached) where its checkpoint left it, as
    ``trainer.resume`` says; then open the writers (called once, by :meth:`Trainer.setup`).
    A run resumed at its end (nothing to train) stops there: it opens no writer and
    changes no file of the finished run (``trainer.finished`` says so)."""
    args, dist = trainer.args, trainer.dist
    fresh = FreshHyperparameters.capture(trainer.optimizers, trainer.schedulers)
    trainer.resumed_from = resume(trainer, trainer.checkpointer)
    trainer.finished = nothing_to_train(trainer)  # said here, once (rank 0)
    if trainer.finished is not None:
        return
    if trainer.resumed_from is not None:
        # Before the writers open metrics.jsonl: events past the checkpoint go.
        continue_log(trainer, trainer.resumed_from)
    apply_accepted(trainer, fresh, say)  # resume_config: accept: the new lr... take effect
    if trainer.autobatch is not None:
        trainer.autobatch.start(trainer)  # the checkpoint's size, or a search after a resize
    # Writers and progress (rank 0), profiler: destination errors surface here.
    observers = build_observers(args, dist, trainer._writers, trainer.hparams,
                                trainer.callbacks)
    trainer.writers = observers.writers
    trainer.callbacks = [*trainer.callbacks, *observers.callbacks]  # CALLBACK_ORDER's last


def start_watchdog(trainer: "Trainer", in_setup: bool = False) -> None:
    """Start ``trainer.watchdog`` as ``trainer.distributed.hang_seconds`` asks (once).

    Set-up has collectives of its own (the model's broadcast, the resume's agreement,
    the start-up checks' batches): so with several ranks the watchdog starts as the group
    is joined (``in_setup``); a single process's starts with the first step."""
    if trainer.watchdog is None and not (in_setup and trainer.dist.world_size == 1):
        args = trainer.args
        # Only a worker torchrun started (which restarts the job) ends by default: a
        # notebook or test that trains in-process is never ended by the library.
        chosen = trainer.end_process_on_hang
        end = bool(chosen) if chosen is not None else "TORCHELASTIC_RUN_ID" in os.environ
        trainer.watchdog = build_watchdog(
            args.distributed.hang_seconds, trainer.dist.rank, trainer.dist.world_size,
            trainer.backend.group_store(), trainer.heartbeat,
            os.path.join(args.output_dir, "hang"), args.distributed.hang_seconds_slow_phases,
            end=end)
    if not in_setup and trainer.watchdog is not None:
        # Training begins: said now, not at the thread's next tick, so that a rank stopped
        # in its first second is reported in its first step.
        trainer.heartbeat.phase = DATA
        trainer.watchdog.publish_now()
