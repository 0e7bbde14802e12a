"""The public Trainer: the loop (:class:`~sailfin.trainer.core.trainer.Loop`) with what a
run needs around it: set-up from the config, the run lock, the start-up checks,
preemption, the hang watchdog, the checkpoint state and the files a finished run leaves
behind (summary.json, final/model.safetensors)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any, Mapping, Optional

import torch

from ...checkpoint.storage import LocalStorage
from ...utils.memory import gc_spares_existing_objects, peak_rss_bytes
from ...utils.voice import configure, say
from ..checkpointing.state import load_trainer_state, trainer_state
from ..core.view import epoch_number
from ..core.trainer import Loop
from ..safety.preemption import Preemption
from ..safety.run_lock import RunLock, take_run_lock
from ..safety.startup_checks import check_schedulers_fit, sanity_validate, train_output_checker
from .bare_weights import save_bare_weights
from .final_model import end_with_chosen_model
from .setup import build_run, start_run, start_watchdog


class Trainer(Loop, contextlib.AbstractContextManager):
    """Trains a :class:`ModuleInterface` as ``args`` says.

    Example::

        args = TrainerArguments(epochs=3, train_batch_size=64, micro_batch_size=32)
        Trainer(MyModule(data=MyData()), args).train()
    """

    _is_setup = False
    _training = False  # inside train(): set-up's watchdog keeps watching the start-up checks
    _evaluation_ready: bool = False  # set up by evaluate()/predict() alone (not to train)
    _evaluation_source: Any = None  # what evaluate()/predict() last loaded
    _run_lock: Optional[RunLock] = None  # rank 0's hold on output_dir, from setup() on
    watchdog: Any = None                 # the hang watchdog, from set-up to train()'s end
    # A hang: True ends the process with 75, False raises HangDetected in the main thread,
    # None (default) ends it only in a worker torchrun started. The sailfin command: True.
    end_process_on_hang: Optional[bool] = None

    # -- the run ---------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Train for ``args.epochs`` (or until ``args.max_steps``); return the summary.
        A run that resumed at its end trains nothing, calls no callback and writes no file:
        its summary has ``nothing_trained`` (the step it finished at and what to change)."""
        self._training = True  # set-up's watchdog carries on into the start-up checks
        try:
            self.setup()
            if self.finished is None:
                # Fail now, not after an epoch: schedule length, val_step, the first
                # train_step.
                check_schedulers_fit(self)
                sanity_validate(self)
        except BaseException:
            self._training = False
            self._stop_watchdog()  # its record says this rank failed (the others may wait)
            self._release_run_lock()
            raise
        if self.finished is not None:
            # Resumed at its end (set-up said so): no step, no validation, no hook, no
            # file written; the finished run's directory stays as it was, byte for byte.
            try:
                summary = self.summary = finish_run(self, write=False)
                summary["nothing_trained"] = self.finished
                return summary
            finally:
                self._end_run()
        self._check_first_output = train_output_checker(self.global_step)
        args = self.args
        # SIGTERM / first Ctrl-C: finish the step, save on every rank, stop (preemption.py).
        self.preemption = Preemption(self.dist.world_size, self.backend.all_reduce_mean,
                                     self.device, args.preemption_check_every_n_steps)
        try:
            start_watchdog(self)  # one process; several: running since set-up joined the group
            self.train_log.ready_since = self.global_step
            self.preemption.install(self.global_step)
            self._notify("on_train_start")  # (its checks may still stop the run)
            if self.backend.threads_note and self.dist.is_main:
                say(self.backend.threads_note)  # sp's CPU threads, once training starts
            self._run_epochs()  # the loop (core/trainer.py)
            self.module.on_end_train(self.global_step)
            summary = self.summary = finish_run(self)
            self._notify("on_train_end")
            end_with_chosen_model(self, summary)  # load_best_model_at_end (final_model.py)
            return summary
        finally:
            try:
                # A signal may land as the handler leaves (torchrun stopping the job):
                # what follows still runs, so that no thread or lock outlives the run.
                self.preemption.uninstall()
            finally:
                self._end_run()

    def _end_run(self) -> None:
        self._training = False
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

    def _hold_run_lock(self, lock: RunLock) -> None:
        self._run_lock = lock  # before it is taken: a stop while taking it releases it

    def _release_run_lock(self) -> None:
        lock, self._run_lock = self._run_lock, None
        if lock is not None:
            lock.release()

    def _stop_watchdog(self) -> None:
        if self.watchdog is not None:
            # Raising here (in a finally) tells the partners' reports who stopped first.
            self.watchdog.stop(failed=sys.exc_info()[0] is not None)
            self.watchdog = None

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def setup(self) -> None:
        """Place the module, build the batch plan, loaders, optimizers, checkpointer and
        writers, and resume from a checkpoint as ``trainer.resume`` says."""
        if self._is_setup:
            return
        if self._evaluation_ready:
            raise RuntimeError("this Trainer was set up by evaluate() or predict(), which "
                               "load weights into the module for evaluation only; build a "
                               "new Trainer (and module) to train")
        configure(self.dist.rank)
        try:
            if self._run_lock is None:  # before anything is written: one run per directory
                take_run_lock(self.args.output_dir, self.dist.is_main, keep=self._hold_run_lock)
            with gc_spares_existing_objects():
                self.attach(build_run(self))  # every piece, from the config
                start_run(self)  # the resume into them, then the writers
        except BaseException:
            if not self._training:  # train() stops them itself when any of its checks fail
                # A set-up that failed leaves nothing running: the watchdog that watched
                # its collectives (its record says this rank failed), the run lock.
                self._stop_watchdog()
                self._release_run_lock()
            raise
        self._is_setup = True
        if not self._training:
            # Called by itself (not by train()): the watchdog that watched set-up's
            # collectives stops here, so that no thread outlives a trainer set up and left;
            # train() starts it again.
            self._stop_watchdog()

    def validate(self) -> dict[str, dict[str, float]]:
        """Run every validation set (set up first, if :meth:`train` has not); name ->
        metrics (also logged)."""
        self.setup()
        return super().validate()

    def evaluate(self, checkpoint: Optional[str] = None, split: str = "val",
                 write: bool = True) -> dict[str, Any]:
        """``split``'s metrics (``val``, ``test`` or a set's name) for ``checkpoint``'s
        weights (best, latest, a step directory, a run's output directory, a
        ``.safetensors`` file or an exported directory; None: the module's weights), as
        training logs them, every sample once; ``eval-<split>.json`` in the output
        directory (``write``). See docs/after-training.md."""
        from .evaluate import evaluate
        return evaluate(self, checkpoint, split, write)

    def predict(self, out: str, checkpoint: Optional[str] = None, split: str = "val"
                ) -> dict[str, Any]:
        """The recipe's ``predict_step`` over ``split``, one row per sample (its ``id``
        first) in input order, written to ``out`` (JSON lines, or ``.parquet``)."""
        from .predict import predict
        return predict(self, checkpoint, split, out)

    def state_dict(self) -> dict[str, Any]:
        """Every stateful piece but the random streams (per rank: ``checkpoint.rng``)."""
        return trainer_state(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put back what :meth:`state_dict` returned (after :meth:`setup` built the pieces)."""
        load_trainer_state(self, state)


def finish_run(trainer: Trainer, write: bool = True) -> dict[str, Any]:
    """The run's summary; the final weights (and EMA weights) and summary.json written
    (unless not ``write``: a run that trained nothing leaves the finished one's files).
    Every rank calls it: under fsdp, gathering each full tensor is a collective."""
    val, device = trainer.last_val_metrics, trainer.device
    summary = {
        "global_step": trainer.global_step,
        "epoch": epoch_number(trainer.epoch, trainer.step_in_epoch),  # from 1, as the console
        "samples_seen": trainer.samples_seen,
        "train_seconds": round(trainer.train_seconds, 4),
        "samples_per_second": (trainer.samples_seen / trainer.train_seconds
                               if trainer.train_seconds > 0 else None),
        "world_size": trainer.dist.world_size,
        "nonfinite_steps": trainer.nonfinite.count,
        "val": next(iter(val.values())) if len(val) == 1 else val,
        "best": trainer.run_stats.best,
        # In bytes; None where the platform cannot tell.
        "peak_memory": {"cpu_rss_bytes": peak_rss_bytes(), "cuda_max_allocated_bytes": (
            int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None)},
        "micro_batch_size": trainer.plan.micro_batch,
        "stopped_early": trainer.stop_reason,
    }
    rate, meter = summary["samples_per_second"], trainer.flops
    if meter.flops_per_sample is not None:
        summary["flops_per_sample"] = meter.flops_per_sample
        summary.update(meter.metrics(rate) if rate else {})  # tflops, mfu
    if trainer.ema is not None:
        summary["ema"] = {"decay": trainer.ema.decay, "updates": trainer.ema.updates,
                          "validated_with_ema": trainer.args.ema.validate}
    for callback in trainer.callbacks:  # e.g. privacy (dp)
        fields = getattr(callback, "summary_fields", None)
        if callable(fields):
            summary.update(fields())
    if trainer.autobatch is not None:
        summary["auto_micro_batch"] = trainer.autobatch.summary()
    if not write:
        return summary
    backend, output_dir, is_main = trainer.backend, trainer.args.output_dir, trainer.dist.is_main
    # Every rank takes part (fsdp gathers one tensor at a time); rank 0 writes.
    backend.save_final_weights(trainer.module,
                               os.path.join(output_dir, "final", "model.safetensors"), is_main)
    bare = save_bare_weights(trainer.module, backend, os.path.join(output_dir, "final"),
                             is_main)  # final/bare.safetensors: the model's own names
    if bare is not None:
        summary["bare_weights"] = bare
    if trainer.ema is not None:  # final/ema.safetensors, the same names
        trainer.ema.save_final(trainer.module, output_dir, backend.save_final_weights, is_main)
    if is_main:  # a temporary file renamed: a reader never sees half a file
        LocalStorage().write_bytes(os.path.join(output_dir, "summary.json"), (json.dumps(
            summary, indent=2, default=_jsonable) + "\n").encode("utf-8"))
    return summary


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return str(value)
