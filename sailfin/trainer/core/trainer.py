"""The training loop: :class:`Loop` runs epochs and steps over the pieces the composition
root (``trainer/compose/``) builds from the config; the backend supplies each step's
pieces. It imports no feature: features follow it as callbacks and see it as a
:class:`~sailfin.trainer.core.view.RunView`."""

from __future__ import annotations

import time
from dataclasses import fields
from typing import Any, Iterable, Iterator, Mapping, Optional

import torch

from ...backends import build_backend
from ...checkpoint.rng import seed_loader
from ...config.trainer import TrainerArguments
from ...data.plan import BatchPlan
from ...distributed import DistEnv
from ...distributed.watchdog import (BACKWARD, DATA, END_OF_EPOCH, END_OF_STEP, FORWARD,
                                    OPTIMIZER, Heartbeat)
from ...interfaces import ModuleInterface
from ...logging import Writer
from .callbacks import Callback
from .loaders import build_train_loader, build_val_loaders, dataset_set_epoch
from .pymarlin_forms import unpack
from .run import Run
from .train_log import TrainLog
from .validation import due_after_epoch, run_validation
from .view import StopSignal


class Loop(Run):
    """The epochs, the steps and validation of a run over its pieces (a :class:`Run`'s
    fields, which :meth:`attach` takes). Users construct :class:`sailfin.trainer.Trainer`,
    which adds set-up, checks and outputs."""

    # Set by Trainer.train before the first step: SIGTERM / first Ctrl-C.
    preemption: StopSignal

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
        self.hparams = hparams  # what the writers log (None: the trainer settings)
        # The recipe's own components (configure_callbacks(), e.g. sailfin.hf's final/hf/
        # writer) follow the loop too.
        own = getattr(module, "configure_callbacks", None)
        self.callbacks: list[Callback] = [*callbacks, *(own() if callable(own) else ())]
        # Counters: together with the seed they say where the data order stands.
        self.global_step = 0      # optimizer steps done
        self.epoch = 0
        self.step_in_epoch = 0    # optimizer steps done in the current epoch
        self.samples_seen = 0
        self.last_val_metrics: dict[str, dict[str, float]] = {}
        self.train_seconds = 0.0
        self.validation_seconds = 0.0  # time spent validating (the time account reads it)
        self.data_seconds = 0.0  # time spent waiting for training data (the time account)
        self.summary: Optional[dict[str, Any]] = None  # set when train() finishes
        self.last_val_step = -1  # the global step last validated at
        self._check_first_output: Any = None  # checks the first train_step's return, once
        # Set (reason, step, ...) by a callback that ends the run early (early stopping).
        self.stop_reason: Optional[dict[str, Any]] = None
        self.heartbeat = Heartbeat()  # where the loop is, for the hang watchdog
        self.train_log = TrainLog()   # the train log line's clocks
        self._hooks_changed = False   # set by remove_callback: the loop looks them up again

    def attach(self, run: Run) -> None:
        """Run with ``run``'s pieces: each of its fields becomes the loop's attribute."""
        for piece in fields(Run):
            setattr(self, piece.name, getattr(run, piece.name))

    # -- the epochs ---------------------------------------------------------------
    def _run_epochs(self) -> None:
        """Epochs until ``args.epochs``, ``args.max_steps`` or a callback's stop; validation
        after the epochs that ask for it, and once more after a run cut short."""
        args = self.args
        while (self.epoch < args.epochs and self.stop_reason is None
               and (args.max_steps is None or self.global_step < args.max_steps)):
            started = time.perf_counter()
            finished_epoch = self._train_epoch()
            self.nonfinite.check()  # a deferred guard reads the epoch's last losses
            self.train_seconds += time.perf_counter() - started
            if not finished_epoch:
                break
            if due_after_epoch(self.args, self.epoch) and self.last_val_step != self.global_step:
                self.validate()  # (unless val_every_n_steps just did)
            self.epoch += 1
            self.step_in_epoch = 0
            self.heartbeat.phase = END_OF_EPOCH
            self._notify("on_epoch_end")
        if ((args.val_every_n_epochs or args.val_every_n_steps)
                and self.last_val_step != self.global_step):
            self.validate()  # stopped early by max_steps: report the final model

    # -- one epoch -------------------------------------------------------------
    def _train_epoch(self) -> bool:
        """Run the rest of the current epoch; False if the run stops inside it (max_steps,
        early stopping). One step: its micro-batches (forward, backward), then the
        optimizer step, then the named hooks."""
        module, args = self.module, self.args
        last = self.steps_per_epoch  # or fewer, when max_steps comes first
        if args.max_steps is not None:
            last = min(last, self.step_in_epoch + max(0, args.max_steps - self.global_step))
        begin, backward_end, step_end, out_of_memory = self._hook_lists()
        on_end_train_step = self.end_train_step_hook
        log_every, beat, log, preemption = (args.log_every_n_steps, self.heartbeat,
                                            self.train_log, self.preemption)
        module.train()
        module.on_begin_train_epoch(self.global_step, self.epoch)
        batches = self._epoch_batches()
        step = self.step_in_epoch
        while step < last:
            beat.step = self.global_step
            plan = self.plan  # every step but an epoch's last has the same micro-batches
            micros = (self._full_micros if step < self._full_steps
                      else self.train_sampler.micro_batches(step))
            for callback in begin:
                callback.on_step_begin(self)
            step_loss, stats = self._forward_backward(batches, micros, out_of_memory)
            if backward_end and any_says_again(backward_end, self, micros):
                batches = None  # the old loader goes first: the same step, replanned
                batches = self._epoch_batches()
                continue
            self._optimizer_step(step_loss)
            self.samples_seen += (plan.global_batch if step < self._full_steps
                                  else self.train_sampler.step_samples(step))
            step += 1
            self.global_step += 1
            self.step_in_epoch = step
            beat.phase = END_OF_STEP
            if on_end_train_step is not None:
                on_end_train_step(self.global_step, step_loss.detach(), stats)
            if self.global_step % log_every == 0:
                log.write(self, step_loss, stats)
            for callback in step_end:
                callback.on_step_end(self)
            if self._hooks_changed:  # a callback left (remove_callback)
                begin, backward_end, step_end, out_of_memory = self._hook_lists()
            if self.global_step >= preemption.check_at and preemption.poll(self.global_step):
                preemption.save_and_stop(self)  # raises TrainingPreempted
            if self.stop_reason is not None:
                return False  # early stopping ended the run
        if last < self.steps_per_epoch:
            return False  # max_steps reached inside the epoch
        module.on_end_train_epoch(self.global_step, self.epoch)
        return True

    def _hook_lists(self) -> tuple[list[Callback], ...]:
        """Each per-step hook's callbacks, looked up once: one that is off costs nothing."""
        self._hooks_changed = False
        return tuple([c for c in self.callbacks
                      if getattr(type(c), hook) is not getattr(Callback, hook)]
                     for hook in ("on_step_begin", "on_backward_end", "on_step_end",
                                  "on_out_of_memory"))

    def remove_callback(self, callback: Callback) -> None:
        """Stop calling ``callback``, from the next step on (a feature whose work is done,
        such as counting the first step's FLOPs, leaves the loop)."""
        self.callbacks.remove(callback)
        self._hooks_changed = True

    def _epoch_batches(self) -> Iterator[Any]:
        """The train loader's batches from the current step of the current epoch."""
        self.train_sampler.set_epoch(self.epoch, self.step_in_epoch)
        if self.dataset_epoch_hook is not None:  # before iter(): new workers copy it
            self.dataset_epoch_hook(self.epoch)
        seed_loader(self.train_loader, self.args.seed, self.epoch, self.dist.rank)
        n, plan = self.num_train_samples, self.plan
        self._full_steps = plan.uniform_steps(n)  # dp (Poisson steps): none
        self._full_micros = plan.micro_batches(0, n, self.dist.rank) if self._full_steps else ()
        self.train_log.restart(self.samples_seen)
        started = time.perf_counter()
        batches = iter(self.train_loader)  # worker processes start here: a data wait too
        self.data_seconds += time.perf_counter() - started
        return batches

    def _forward_backward(self, batches: Iterator[Any], micros: Any, out_of_memory: list
                          ) -> tuple[Optional[torch.Tensor], Optional[Mapping[str, Any]]]:
        """Forward and backward of each micro-batch of one step; the summed loss and the
        last micro-batch's stats. (None, None) when a callback handles running out of memory."""
        backend, module, beat, clock = self.backend, self.module, self.heartbeat, time.perf_counter
        step_loss, stats = None, None
        started = asked = ready = clock()
        waited = 0.0  # seconds in next(batches) this step: the time account's data wait
        try:
            for micro in micros:
                beat.phase = DATA
                batch = next(batches)
                beat.phase, fetched = FORWARD, clock()
                waited += fetched - asked
                if micro.padding:
                    step_loss, stats = padding_micro_batch(backend, module, self.global_step,
                                                          batch, step_loss, stats)
                    asked = clock()
                    continue
                out = backend.train_step(module, self.global_step, batch, micro.last)
                if self._check_first_output is not None:
                    self._check_first_output(out)
                    self._check_first_output = None
                # stats: a dict, None or PyMarlin's extras; a bare loss needs no unpacking
                loss, stats = (out, None) if type(out) is not tuple else unpack(out)
                if micro.weight != 1.0:
                    # Weight by the micro-batch's share of the step: the summed
                    # gradient is the one-big-batch gradient even for short batches.
                    loss = loss * micro.weight
                beat.phase, ready = BACKWARD, clock()
                backend.backward(loss)
                step_loss = loss if step_loss is None else step_loss.detach() + loss.detach()
                if not micro.last:  # the next micro-batch's wait starts here
                    asked = clock()
        except torch.OutOfMemoryError:
            if not out_of_memory:
                raise
            for callback in out_of_memory:  # (the retry's clock holds its data wait)
                callback.on_out_of_memory(self)
            return None, None  # returning drops the traceback that holds the activations
        self.data_seconds += waited
        self.train_log.ready_seconds += ready - started  # straggler figures (train_log.py)
        return step_loss, stats

    def _optimizer_step(self, step_loss: torch.Tensor) -> None:
        """Clip, step, schedule, zero the gradients: nanoGPT's order."""
        self.heartbeat.phase = OPTIMIZER
        if self.end_backward_hook is not None:
            self.end_backward_hook(self.global_step, step_loss)
        if self.nonfinite.observe(step_loss, self.global_step, self.epoch, self.step_in_epoch):
            if self.args.max_grad_norm is not None:  # False above: skip the step
                self.backend.clip_grad_norm(self.trainable_params, self.optimizers,
                                            self.args.max_grad_norm)
            if self.backend.optimizer_step(self.optimizers):
                for scheduler in self.schedulers:  # a skipped (non-finite) step keeps the schedule
                    scheduler.step()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    # -- what features may change --------------------------------------------------
    def replan(self, micro_batch_size: int) -> None:
        """Run with another micro-batch size from the current step: the batch plan, the
        train loader and sampler (and validation loaders that follow the micro-batch) are
        rebuilt; the global batch, and so which samples form each step, stays."""
        args, dist = self.args, self.dist
        self.plan = self.backend.batch_plan(BatchPlan.create(
            args.train_batch_size, micro_batch_size, dist.world_size, args.drop_last,
            args.max_train_steps_per_epoch))
        self.train_loader, self.train_sampler = build_train_loader(
            self.module, self.plan, dist, args)
        self.dataset_epoch_hook = dataset_set_epoch(self.train_loader)
        if args.val_batch_size is None:  # validation batches follow the micro-batch
            self.val_loaders = build_val_loaders(self.module, micro_batch_size, dist)

    def exclude_time(self, seconds: float) -> None:
        """``seconds`` spent inside a step's hooks on something else (validation every N
        steps): not training time, nor part of the next log line's throughput."""
        self.train_seconds -= seconds  # the epoch's clock, added at its end, counted them
        self.train_log.exclude(seconds)

    # -- validation --------------------------------------------------------------
    def validate(self) -> dict[str, dict[str, float]]:
        """Run every validation set; return name -> metrics (also logged)."""
        if not self.val_loaders:
            return {}
        started = time.perf_counter()
        results = run_validation(self)
        self.validation_seconds += time.perf_counter() - started
        self.writers.flush()
        self.last_val_metrics = results
        self.last_val_step = self.global_step
        self._notify("on_validation_end", results)
        return results

    def _notify(self, event: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, event)(self, *args)


def any_says_again(callbacks: list[Callback], trainer: Loop, micros: Any) -> bool:
    """``on_backward_end`` in order, until one asks for the step again."""
    samples = sum(m.count for m in micros)
    return any(c.on_backward_end(trainer, samples) for c in callbacks)


def padding_micro_batch(backend: Any, module: Any, global_step: int, batch: Any,
                        step_loss: Optional[torch.Tensor], stats: Optional[Mapping[str, Any]]
                        ) -> tuple[torch.Tensor, Optional[Mapping[str, Any]]]:
    """Run a weight-0 padding micro-batch (see :mod:`sailfin.data.plan`): this rank
    joins its partners' collectives and the gradient all-reduce, and adds nothing.
    ``module.padding_batch`` is True meanwhile, so a recipe can leave it out of its
    own counts. The step's stats stay those of its last real micro-batch; a rank
    with none takes the padding's, so every rank logs the same stat names."""
    module.padding_batch = True
    try:
        out = backend.train_step(module, global_step, batch, True)
    finally:
        module.padding_batch = False
    loss, pad_stats = unpack(out)
    loss = loss * 0.0
    backend.backward(loss)
    step_loss = loss if step_loss is None else step_loss.detach() + loss.detach()
    return step_loss, pad_stats if stats is None else stats
