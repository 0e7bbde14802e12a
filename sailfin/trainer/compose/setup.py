"""What :meth:`Trainer.setup` builds, in order: the batch plan and loaders, the
optimizers, the checkpointer and the callbacks behind each feature, the resume, then
the writers. Each piece is an attribute of the trainer the loop reads."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

from ...checkpoint import build_checkpointer
from ...data.plan import BatchPlan
from ...interfaces import RecipeError
from ...logging.destination import check_directory
from ...utils.seed import seed_everything
from ...utils.voice import say
from ..checkpointing.accepted import FreshHyperparameters, apply_accepted
from ..checkpointing.memory_snapshots import memory_snapshot_callback
from ..checkpointing.resume import resume
from ..checkpointing.saver import checkpoint_callback, checkpoint_callbacks
from ..features.autobatch import auto_micro_batch
from ..features.loop_features import build_loop_features
from ..features.observe import build_observers
from ..features.run_stats import RunStats
from ..features.time_account import TimeAccount
from .watchdog import start_watchdog
from ..safety.nonfinite import NonFiniteGuard
from ..core.callbacks import Callback
from ..core.hooks import as_list, overridden
from ..core.loaders import build_train_loader, build_val_loaders, dataset_set_epoch
from ..core.pymarlin_forms import train_step_end_caller, val_epoch_end_caller

if TYPE_CHECKING:
    from .trainer import Trainer

# The callbacks in the order the loop calls them, by the piece that gives them; each
# piece's place and why. ``build_run`` fills them (in_order); nothing else orders them.
CALLBACK_ORDER = (
    "given",             # Trainer(callbacks=...), then the recipe's own (recipe_callbacks)
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


def build_run(trainer: "Trainer") -> None:
    """Set up ``trainer`` for its run (called once, by :meth:`Trainer.setup`)."""
    args, dist = trainer.args, trainer.dist
    seed_everything(args.seed + dist.rank)  # per-rank streams (dropout) differ
    # micro_batch_size: auto searches from the largest size (see autobatch.py).
    trainer.autobatch = auto_micro_batch(args, dist.rank, dist.world_size)
    size = args.micro_batch_size if trainer.autobatch is None else trainer.autobatch.size
    trainer.plan = BatchPlan.create(args.train_batch_size, size, dist.world_size,
                                    args.drop_last, args.max_train_steps_per_epoch,
                                    micro_batch_limit=args.gpu_batch_size_limit,
                                    note=say if dist.is_main else None)
    trainer.backend.setup(trainer.module)
    start_watchdog(trainer, in_setup=True)  # from the first collective: resume, checks
    trainer.plan = trainer.backend.batch_plan(trainer.plan)  # dp: unweighted, Poisson steps
    trainer.device = trainer.backend.device
    trainer.train_loader, trainer.train_sampler = build_train_loader(
        trainer.module, trainer.plan, dist, args)
    trainer.num_train_samples = trainer.train_sampler.num_samples
    trainer.steps_per_epoch = trainer.plan.steps_in_epoch(trainer.num_train_samples)
    trainer.val_loaders = build_val_loaders(
        trainer.module, args.val_batch_size or trainer.plan.micro_batch, dist)
    optimizers, schedulers = trainer.module.get_optimizers_schedulers(
        trainer.steps_per_epoch, args.epochs)
    trainer.optimizers = as_list(optimizers, "optimizers")
    trainer.schedulers = as_list(schedulers, "schedulers")
    if not trainer.optimizers:
        raise RecipeError("get_optimizers_schedulers returned no optimizer: return "
                          "([optimizer, ...], [scheduler, ...]) (the schedulers may be [])")
    # dp: clipping, noise and accounting around the optimizers (a no-op otherwise).
    trainer.backend.attach_optimizers(trainer.optimizers, trainer.num_train_samples,
                                   trainer.steps_per_epoch)
    if dist.is_main:
        # summary.json, weights, metrics and (by default) checkpoints go here:
        # fail now, not after training.
        check_directory(args.output_dir, "output",
                        who="sailfin (summary.json, final weights, checkpoints)")
    trainer.checkpointer = build_checkpointer(args, dist, trainer.backend.barrier)
    saver = trainer.saver = checkpoint_callback(trainer.checkpointer, args.checkpoint)
    trainer.run_stats = RunStats(args.checkpoint.best_metric, args.checkpoint.best_mode)
    # EMA, step validation, early stopping: before the saver, which saves their state.
    features = build_loop_features(trainer.module, args, trainer.backend, trainer.dist)
    trainer.ema, trainer.flops = features.ema, features.flops
    memory = memory_snapshot_callback(trainer.checkpointer, args, saver, trainer.module)
    pieces: dict[str, Sequence[Callback]] = {
        "given": trainer.callbacks,
        "features": features.callbacks,
        "run_stats": [trainer.run_stats],
        "saver": checkpoint_callbacks(saver),
        "memory_snapshots": memory,
        "autobatch": [trainer.autobatch] if trainer.autobatch is not None else [],
        "last_features": features.last_callbacks,
    }
    trainer.callbacks = in_order(pieces)  # what resume restores the state of
    # The time account reads how far a killed run logged before resuming trims metrics.jsonl.
    account = TimeAccount(args.output_dir, dist.is_main, args.resume != "never",
                          trainer.heartbeat)
    # Before the writers open metrics.jsonl: resuming trims events past the checkpoint.
    fresh = FreshHyperparameters.capture(trainer.optimizers, trainer.schedulers)
    trainer.resumed_from = resume(trainer, trainer.checkpointer)
    apply_accepted(trainer, fresh, say)  # resume_config: accept: the new lr... take effect
    if trainer.autobatch is not None:
        trainer.autobatch.start(trainer)  # the checkpoint's size, or a search after a resize
    pieces["time_account"] = [account]
    trainer.time_account = account  # train() stops its sampler thread on every path
    # Writers and progress (rank 0), profiler: destination errors surface here.
    observers = build_observers(args, dist, trainer._writers, trainer._hparams,
                                in_order(pieces))
    trainer.writers = observers.writers
    pieces["observers"] = observers.callbacks
    trainer.callbacks = in_order(pieces)
    trainer.nonfinite = NonFiniteGuard(args.on_nonfinite, trainer.device, dist.world_size,
                                    trainer.backend.all_reduce_mean,
                                    getattr(trainer.train_sampler, "step_indices", None))
    trainer.trainable_params = [p for p in trainer.module.parameters() if p.requires_grad]
    trainer._on_end_backward = overridden(trainer.module, "on_end_backward")
    # The recipe's callbacks, called with what their signatures take (PyMarlin's too).
    trainer._on_end_train_step, trainer._on_end_val_epoch = (
        train_step_end_caller(trainer.module), val_epoch_end_caller(trainer.module))
    for snapshots in memory:  # a snapshot's write is waited for before its step's log
        trainer._on_end_train_step = snapshots.before_log(trainer, trainer._on_end_train_step)
    trainer._dataset_set_epoch = dataset_set_epoch(trainer.train_loader)
