"""The training loop. It owns the loop; the backend supplies each step's pieces."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any, Iterable, Mapping, Optional

import torch

from ...backends import build_backend
from ...checkpoint import build_checkpointer
from ...checkpoint.checkpointer import say
from ...checkpoint.rng import seed_loader
from ...config.trainer import TrainerArguments
from ...data.plan import BatchPlan
from ...distributed import DistEnv
from ...distributed.watchdog import (BACKWARD, DATA, END_OF_EPOCH, END_OF_STEP, FORWARD,
                                    OPTIMIZER, VALIDATION, Heartbeat, build_watchdog)
from ...interfaces import ModuleInterface
from ...logging import Writer
from ...logging.destination import check_directory
from ...utils.log import configure_logging
from ...utils.seed import seed_everything
from ..checkpointing.accepted import FreshHyperparameters, apply_accepted
from ..features.autobatch import auto_micro_batch
from .callbacks import Callback
from ..checkpointing.resume import resume
from ..checkpointing.saver import checkpoint_callback
from ..features.loop_features import build_loop_features
from .loaders import build_train_loader, build_val_loaders, dataset_set_epoch
from ..safety.nonfinite import NonFiniteGuard
from ..features.observe import build_observers
from ..safety.preemption import Preemption, save_and_stop
from ..safety.run_lock import RunLock, take_run_lock
from ..features.run_stats import RunStats
from ..safety.startup_checks import check_schedulers_fit, sanity_validate, train_output_checker
from ..features.stragglers import loss_and_stragglers
from .outputs import finish_run
from ..checkpointing.state import load_trainer_state, trainer_state
from .pymarlin_forms import loggable, train_step_end_caller, unpack, val_epoch_end_caller
from .validation import merge_outputs, val_batches


class Trainer:
    """Trains a :class:`ModuleInterface` as ``args`` says.

    Example::

        args = TrainerArguments(epochs=3, train_batch_size=64, micro_batch_size=32)
        Trainer(MyModule(data=MyData()), args).train()
    """

    def __init__(self, module: ModuleInterface, args: Optional[TrainerArguments] = None, *,
                 dist: Optional[DistEnv] = None, backend: Any = None,
                 writers: Optional[Iterable[Writer]] = None,
                 callbacks: Iterable[Callback] = (),
                 hparams: Optional[Mapping[str, Any]] = None) -> None:
        self.module = module
        self.args = args or TrainerArguments()
        self.dist = dist or DistEnv.from_config(self.args.distributed)
        self.backend = backend if backend is not None else build_backend(self.args, self.dist)
        self._writers = writers
        self._hparams = hparams  # logged by the writers; default: the trainer settings
        self.callbacks: list[Callback] = list(callbacks)
        # Counters: together with the seed they say where the data order stands.
        self.global_step = 0      # optimizer steps done
        self.epoch = 0
        self.step_in_epoch = 0    # optimizer steps done in the current epoch
        self.samples_seen = 0
        self.last_val_metrics: dict[str, dict[str, float]] = {}
        self.train_seconds = 0.0
        self.summary: Optional[dict[str, Any]] = None  # set when train() finishes
        self._is_setup = False
        self._last_val_step = -1
        self._check_first_output: Any = None  # checks the first train_step's return, once
        self._run_lock: Optional[RunLock] = None  # rank 0's hold on output_dir
        # Set (reason, step, ...) by a callback that ends the run early (early stopping).
        self.stop_reason: Optional[dict[str, Any]] = None
        self.heartbeat = Heartbeat()  # where the loop is, for the hang watchdog
        self.watchdog = None
        self._ready_seconds = 0.0     # this rank's own work since the last log line
        self._ready_since = 0         # ... which came after this many steps

    # -- the run ---------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Train for ``args.epochs`` (or until ``args.max_steps``); return the summary."""
        try:
            self.setup()
            # Fail now, not after an epoch: schedule length, val_step, the first train_step.
            check_schedulers_fit(self)
            sanity_validate(self)
        except BaseException:
            self._release_run_lock()
            raise
        self._check_first_output = train_output_checker(self.global_step)
        args = self.args
        # SIGTERM / first Ctrl-C: finish the step, save on every rank, stop (preemption.py).
        self.preemption = Preemption(self.dist.world_size, self.backend.all_reduce_mean,
                                     self.device, args.preemption_check_every_n_steps)
        try:
            self.watchdog = build_watchdog(  # trainer.distributed.hang_seconds
                args.distributed.hang_seconds, self.dist.rank, self.dist.world_size,
                self.backend.group_store(), self.heartbeat,
                os.path.join(args.output_dir, "hang"))
            self._ready_since = self.global_step
            self.preemption.install(self.global_step)
            self._notify("on_train_start")
            while (self.epoch < args.epochs and not self._reached_max_steps()
                   and self.stop_reason is None):
                started = time.perf_counter()
                finished_epoch = self._train_epoch()
                self.nonfinite.check()  # a deferred guard reads the epoch's last losses
                self.train_seconds += time.perf_counter() - started
                if not finished_epoch:
                    break
                if self._should_validate(self.epoch) and self._last_val_step != self.global_step:
                    self.validate()  # (unless val_every_n_steps just did)
                self.epoch += 1
                self.step_in_epoch = 0
                self.heartbeat.phase = END_OF_EPOCH
                self._notify("on_epoch_end")
            if ((args.val_every_n_epochs or args.val_every_n_steps)
                    and self._last_val_step != self.global_step):
                self.validate()  # stopped early by max_steps: report the final model
            self.module.on_end_train(self.global_step)
            summary = self.summary = finish_run(self)
            self._notify("on_train_end")
            return summary
        finally:
            self.preemption.uninstall()
            self.flops.abort()  # an error inside the counted step leaves the counting mode
            try:
                self.checkpointer.close()  # a background save finishes, or reports its error
            finally:
                self._stop_watchdog()
                self.writers.flush()  # close() closes them; validate() may still log
                self._release_run_lock()

    def close(self) -> None:
        """Close the writers and leave the process group (DDP). Safe to call twice."""
        try:
            self._stop_watchdog()
            if self._is_setup:
                self.writers.close()
            self.backend.teardown()
        finally:
            self._release_run_lock()

    def _release_run_lock(self) -> None:
        lock, self._run_lock = self._run_lock, None
        if lock is not None:
            lock.release()

    def _stop_watchdog(self) -> None:
        if self.watchdog is not None:
            # Raising here (in a finally) tells the partners' reports who stopped first.
            self.watchdog.stop(failed=sys.exc_info()[0] is not None)
            self.watchdog = None

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def setup(self) -> None:
        """Place the module, build the batch plan, loaders, optimizers, checkpointer and
        writers, and resume from a checkpoint as ``trainer.resume`` says."""
        if self._is_setup:
            return
        args, dist = self.args, self.dist
        configure_logging(dist.rank)
        if self._run_lock is None:  # before anything is written there: one run per directory
            self._run_lock = take_run_lock(args.output_dir, dist.is_main)
        seed_everything(args.seed + dist.rank)  # per-rank streams (dropout) differ
        # micro_batch_size: auto searches from the largest size (see autobatch.py).
        self.autobatch = auto_micro_batch(args, dist.rank, dist.world_size)
        self.plan = BatchPlan.create(args.train_batch_size, args.micro_batch_size
                                     if self.autobatch is None else self.autobatch.size,
                                     dist.world_size, args.drop_last,
                                     args.max_train_steps_per_epoch,
                                     micro_batch_limit=args.gpu_batch_size_limit)
        self.backend.setup(self.module)
        self.plan = self.backend.batch_plan(self.plan)  # dp: unweighted, Poisson steps
        self.device = self.backend.device
        self.train_loader, self.train_sampler = build_train_loader(
            self.module, self.plan, dist, args)
        self.num_train_samples = self.train_sampler.num_samples
        self.steps_per_epoch = self.plan.steps_in_epoch(self.num_train_samples)
        self.val_loaders = build_val_loaders(
            self.module, args.val_batch_size or self.plan.micro_batch, dist)
        optimizers, schedulers = self.module.get_optimizers_schedulers(
            self.steps_per_epoch, args.epochs)
        self.optimizers = _as_list(optimizers, "optimizers")
        self.schedulers = _as_list(schedulers, "schedulers")
        if not self.optimizers:
            raise ValueError("get_optimizers_schedulers returned no optimizer")
        # dp: clipping, noise and accounting around the optimizers (a no-op otherwise).
        self.backend.attach_optimizers(self.optimizers, self.num_train_samples,
                                       self.steps_per_epoch)
        if dist.is_main:
            # summary.json, weights, metrics and (by default) checkpoints go here:
            # fail now, not after training.
            check_directory(args.output_dir, "output",
                            who="sailfin (summary.json, final weights, checkpoints)")
        self.checkpointer = build_checkpointer(args, dist, self.backend.barrier)
        saver = self.saver = checkpoint_callback(self.checkpointer, args.checkpoint)
        self.run_stats = RunStats(args.checkpoint.best_metric, args.checkpoint.best_mode)
        # EMA, step validation, early stopping: before the saver, which saves their state.
        features = build_loop_features(self.module, args, self.backend, self.dist)
        self.ema, self.flops = features.ema, features.flops
        self.callbacks += features.callbacks
        self.callbacks += [self.run_stats] + ([saver] if saver is not None else [])
        if self.autobatch is not None:  # its size is kept in checkpoints
            self.callbacks.append(self.autobatch)
        # Before the writers open metrics.jsonl: resuming trims events past the checkpoint.
        fresh = FreshHyperparameters.capture(self.optimizers, self.schedulers)
        self.resumed_from = resume(self, self.checkpointer)
        apply_accepted(self, fresh, say)  # resume_config: accept: the new lr... take effect
        if self.autobatch is not None:
            self.autobatch.start(self)  # the checkpoint's size, or a search after a resize
        # Writers and progress (rank 0), profiler: destination errors surface here.
        observers = build_observers(args, dist, self._writers, self._hparams, self.callbacks)
        self.writers = observers.writers
        self.callbacks.extend(observers.callbacks)
        self.nonfinite = NonFiniteGuard(args.on_nonfinite, self.device, dist.world_size,
                                        self.backend.all_reduce_mean,
                                        getattr(self.train_sampler, "step_indices", None))
        self._params = [p for p in self.module.parameters() if p.requires_grad]
        self._dataset_set_epoch = dataset_set_epoch(self.train_loader)
        # The recipe's callbacks, called with what their signatures take (PyMarlin's too).
        self._on_end_train_step = train_step_end_caller(self.module)
        self._on_end_val_epoch = val_epoch_end_caller(self.module)
        self._is_setup = True

    # -- one epoch -------------------------------------------------------------
    def _train_epoch(self, redo: bool = False) -> bool:
        """Run the rest of the current epoch; False if max_steps stopped it early.
        ``redo``: the same epoch again from the current step (a smaller micro-batch)."""
        module, backend, plan = self.module, self.backend, self.plan
        args, rank, n = self.args, self.dist.rank, self.num_train_samples
        optimizers, schedulers = self.optimizers, self.schedulers
        log_every, max_norm = args.log_every_n_steps, args.max_grad_norm
        # Steps this call runs: the rest of the epoch, or fewer if max_steps comes first.
        last = self.steps_per_epoch
        if args.max_steps is not None:
            last = min(last, self.step_in_epoch + max(0, args.max_steps - self.global_step))
        step_callbacks = [c for c in self.callbacks
                          if type(c).on_step_end is not Callback.on_step_end]
        on_end_backward = _overridden(module, "on_end_backward")
        on_end_train_step = self._on_end_train_step
        observe = self.nonfinite.observe
        check = self._check_first_output  # None once the first train_step was checked
        preemption = self.preemption
        # Every step but an epoch's last has the same shape: look it up once.
        full_steps = plan.uniform_steps(n)
        sampler = self.train_sampler
        full_micros = plan.micro_batches(0, n, rank) if full_steps else ()
        global_batch = plan.global_batch
        flops = self.flops if self.flops.pending else None  # counts the first step only
        auto = self.autobatch  # None unless micro_batch_size is auto
        beat, clock = self.heartbeat, time.perf_counter  # attribute stores, read by a thread

        self.train_sampler.set_epoch(self.epoch, self.step_in_epoch)
        module.train()
        if not redo:
            module.on_begin_train_epoch(self.global_step, self.epoch)
        if self._dataset_set_epoch is not None:  # before iter(): new workers copy it
            self._dataset_set_epoch(self.epoch)
        seed_loader(self.train_loader, args.seed, self.epoch, rank)  # iter() leaves torch's RNG be
        batches = iter(self.train_loader)
        self._log_clock = (time.perf_counter(), self.samples_seen)
        for step in range(self.step_in_epoch, last):
            step_loss, stats = None, None
            beat.step = self.global_step
            started = ready = clock()
            micros = full_micros if step < full_steps else sampler.micro_batches(step)
            if flops is not None:
                flops.start()
            if auto is not None:
                auto.begin_step(backend)
            try:
                for micro in micros:
                    beat.phase = DATA
                    batch = next(batches)
                    beat.phase = FORWARD
                    if micro.padding:
                        step_loss, stats = self._padding_micro_batch(batch, step_loss, stats)
                        continue
                    out = backend.train_step(module, self.global_step, batch, micro.last)
                    if check is not None:
                        check(out)
                        check = self._check_first_output = None
                    loss, stats = unpack(out)  # stats: a dict, None or PyMarlin's extras
                    if micro.weight != 1.0:
                        # Weight by the micro-batch's share of the step: the summed
                        # gradient is the one-big-batch gradient even for short batches.
                        loss = loss * micro.weight
                    beat.phase, ready = BACKWARD, clock()
                    backend.backward(loss)
                    step_loss = loss if step_loss is None else step_loss.detach() + loss.detach()
            except torch.OutOfMemoryError:
                if auto is None:
                    raise
                auto.out_of_memory(step, self.global_step)
            # Out of memory (on any rank): redo this step with a smaller micro-batch,
            # from its first one, once the old loader is gone (after the except block,
            # whose traceback holds the failed attempt's activations).
            if auto is not None and auto.end_step(self, step):
                self.flops.abort()  # counts the redone step instead
                batches = out = loss = step_loss = None
                return self._train_epoch(redo=True)
            if flops is not None:
                flops.stop(sum(m.count for m in micros))
                flops = None
            self._ready_seconds += ready - started  # straggler figures (stragglers.py)
            beat.phase = OPTIMIZER
            if on_end_backward is not None:
                on_end_backward(self.global_step, step_loss)
            if observe(step_loss, self.global_step, self.epoch, step):  # False: skip the step
                if max_norm is not None:
                    backend.clip_grad_norm(self._params, optimizers, max_norm)
                if backend.optimizer_step(optimizers):
                    for scheduler in schedulers:  # a skipped (non-finite) step keeps the schedule
                        scheduler.step()
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            self.global_step += 1
            self.step_in_epoch = step + 1
            self.samples_seen += (global_batch if step < full_steps
                                  else sampler.step_samples(step))
            beat.phase = END_OF_STEP
            if on_end_train_step is not None:
                on_end_train_step(self.global_step, step_loss.detach(), stats)
            if self.global_step % log_every == 0:
                self._log_train(step_loss, stats)
            for callback in step_callbacks:
                callback.on_step_end(self)
            if self.global_step >= preemption.check_at and preemption.poll(self.global_step):
                save_and_stop(self)  # raises TrainingPreempted
            if self.stop_reason is not None:
                return False  # early stopping ended the run
        if last < self.steps_per_epoch:
            return False  # max_steps reached inside the epoch
        module.on_end_train_epoch(self.global_step, self.epoch)
        return True

    def _padding_micro_batch(self, batch: Any, step_loss: Optional[torch.Tensor],
                             stats: Optional[Mapping[str, Any]]
                             ) -> tuple[torch.Tensor, Optional[Mapping[str, Any]]]:
        """Run a weight-0 padding micro-batch (see :mod:`sailfin.data.plan`): this rank
        joins its partners' collectives and the gradient all-reduce, and adds nothing.
        ``module.padding_batch`` is True meanwhile, so a recipe can leave it out of its
        own counts. The step's stats stay those of its last real micro-batch; a rank
        with none takes the padding's, so every rank logs the same stat names."""
        module = self.module
        module.padding_batch = True
        try:
            out = self.backend.train_step(module, self.global_step, batch, True)
        finally:
            module.padding_batch = False
        loss, pad_stats = unpack(out)
        loss = loss * 0.0
        self.backend.backward(loss)
        step_loss = loss if step_loss is None else step_loss.detach() + loss.detach()
        return step_loss, pad_stats if stats is None else stats

    def _log_train(self, step_loss: torch.Tensor, stats: Optional[Mapping[str, Any]]) -> None:
        # The only host-device sync of the loop, once every log_every_n_steps.
        self.nonfinite.check()
        now = time.perf_counter()
        then, seen = self._log_clock
        self._log_clock = (now, self.samples_seen)
        stragglers: dict[str, float] = {}
        if self.dist.is_distributed:  # each rank's own step time rides with the loss
            loss, stragglers = loss_and_stragglers(self.backend, step_loss, self._ready_seconds,
                                                   self.global_step - self._ready_since)
        else:
            loss = self.backend.all_reduce_mean(step_loss.detach()).item()
        self._ready_seconds, self._ready_since = 0.0, self.global_step
        metrics: dict[str, float] = {"loss": loss,
                                     "lr": self.optimizers[0].param_groups[0]["lr"]}
        metrics.update(stragglers)
        if loggable(stats):
            metrics.update(self._reduce_stats(stats))
        if self.nonfinite.count:
            metrics["nonfinite_steps"] = self.nonfinite.count
        if now > then:
            metrics["samples_per_second"] = (self.samples_seen - seen) / (now - then)
            metrics.update(self.flops.metrics(metrics["samples_per_second"]))  # tflops, mfu
        # Unreadable samples a dataset skipped (on_error: skip), counted over its workers.
        skipped = getattr(getattr(self.train_loader, "dataset", None), "skipped_samples", 0)
        if skipped:
            metrics["skipped_samples"] = skipped
        self.writers.log_metrics(metrics, self.global_step, self.epoch, "train")

    def _reduce_stats(self, stats: Mapping[str, Any]) -> dict[str, Any]:
        """The recipe's step stats, averaged over ranks (one all-reduce for all tensors)."""
        tensors = {k: v for k, v in stats.items()
                   if isinstance(v, torch.Tensor) and v.numel() == 1}
        out = {k: _scalar(v) for k, v in stats.items() if k not in tensors}
        if tensors and self.dist.is_distributed:
            stacked = torch.stack([v.detach().float().reshape(()) for v in tensors.values()])
            values = self.backend.all_reduce_mean(stacked).tolist()
            out.update(zip(tensors, values))
        else:
            out.update({k: v.item() for k, v in tensors.items()})
        return out

    # -- validation --------------------------------------------------------------
    def validate(self) -> dict[str, dict[str, float]]:
        """Run every validation set; return name -> metrics (also logged)."""
        self.setup()
        results: dict[str, dict[str, float]] = {}
        if not self.val_loaders:
            return results
        was_training = self.module.training
        self.heartbeat.phase = VALIDATION
        self.module.eval()
        with torch.no_grad(), self._validation_weights():
            for name, loader in self.val_loaders.items():
                # Validating draws nothing from the training's random streams.
                seed_loader(loader, self.args.seed, self.global_step, self.dist.rank)
                sizes: list[int] = []  # samples per batch: a 0-d output counts once per sample
                local = merge_outputs(self.backend.validation_outputs(
                    self.module, self.global_step,
                    self.heartbeat.count(val_batches(loader, self.args, sizes))), sizes=sizes)
                outputs = self.backend.gather_outputs(local)
                metrics = self._on_end_val_epoch(self.global_step, outputs, name) or {}
                metrics = {k: _scalar(v) for k, v in metrics.items()}
                results[name] = metrics
                if metrics:
                    event = dict(metrics)
                    if len(self.val_loaders) > 1:
                        event = {"dataset": name, **event}
                    self.writers.log_metrics(event, self.global_step, self.epoch, "val")
        self.module.train(was_training)
        self.writers.flush()
        self.last_val_metrics = results
        self._last_val_step = self.global_step
        self._notify("on_validation_end", results)
        return results

    # -- checkpoint state ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every stateful piece but the random streams (per rank: ``checkpoint.rng``)."""
        return trainer_state(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put back what :meth:`state_dict` returned (after :meth:`setup` built the pieces)."""
        load_trainer_state(self, state)

    def _validation_weights(self) -> Any:
        """The EMA weights swapped in for validation when ``trainer.ema.validate`` says."""
        if self.ema is not None and self.args.ema.validate:
            return self.ema.swapped_in(self.module)
        return contextlib.nullcontext()

    def _should_validate(self, epoch: int) -> bool:
        every = self.args.val_every_n_epochs
        return bool(every) and ((epoch + 1) % every == 0 or epoch + 1 == self.args.epochs)

    def _reached_max_steps(self) -> bool:
        return self.args.max_steps is not None and self.global_step >= self.args.max_steps

    def _notify(self, event: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, event)(self, *args)


def _overridden(module: ModuleInterface, name: str) -> Any:
    """The module's callback if the recipe overrides it, else None (skip the call)."""
    if getattr(type(module), name, None) is getattr(ModuleInterface, name):
        return None
    return getattr(module, name)


def _as_list(value: Any, what: str) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _scalar(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    return value

