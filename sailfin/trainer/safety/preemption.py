"""Preemption: SIGTERM (or a first Ctrl-C) ends the run cleanly, with a checkpoint
(docs/robustness.md). The handler only notes the signal; the loop finishes its optimizer
step, every rank saves the same step and the run exits with :data:`PREEMPTED_EXIT_CODE`.
A worker whose launcher (torchrun, ``sailfin launch``) is gone stops the same way
(:mod:`sailfin.distributed.launcher_watch`).
Several ranks agree every ``trainer.preemption_check_every_n_steps`` steps with one
all-reduce of one number; between those the loop pays one integer comparison per step."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Optional

import torch

from ...distributed.exit_codes import PREEMPTED_EXIT_CODE  # noqa: F401 (the CLI reads it here)
from ...distributed.launch_notes import TRAINING, leave_note
from ...distributed.launcher_watch import LauncherWatch, under_a_launcher
from ...utils.voice import say

_NEVER = sys.maxsize
# torchrun's agent passes a Ctrl-C it received on to its workers, which got the same
# Ctrl-C from the terminal: a second SIGINT this soon is that copy, not a second press.
_SAME_PRESS_SECONDS = 1.0


class TrainingPreempted(Exception):
    """The run stopped on a signal after saving ``checkpoint`` at ``step``."""

    def __init__(self, signal_name: str, step: int, checkpoint: Optional[str]) -> None:
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        saved = (f"saved checkpoint {checkpoint}" if checkpoint
                 else "no checkpoint could be saved")
        super().__init__(f"stopped by {signal_name} after step {step}; {saved}. Run the same "
                         "command again to resume from it")


class Preemption:
    """Notes SIGTERM/SIGINT and tells the loop when every rank should stop.

    Example::

        preemption = Preemption(world_size=1, all_reduce_mean=lambda t: t,
                                device=torch.device("cpu"))
        preemption.install(global_step=0)
        try:
            for step in range(1, n + 1):
                train_one_step()
                if step >= preemption.check_at and preemption.poll(step):
                    preemption.save_and_stop(trainer)   # raises TrainingPreempted
        finally:
            preemption.uninstall()
    """

    def __init__(self, world_size: int, all_reduce_mean: Callable[[torch.Tensor], torch.Tensor],
                 device: torch.device, check_every: int = 10) -> None:
        self.distributed = world_size > 1
        self.all_reduce_mean = all_reduce_mean
        self.device = device
        self.check_every = check_every
        self.signal_name: Optional[str] = None
        self.check_at = _NEVER
        self._sigint_at: Optional[float] = None
        self._previous: dict[int, Any] = {}
        self._pid = os.getpid()
        # Under torchrun: its parent, the launcher, is watched from install to uninstall.
        self._launcher = LauncherWatch(self._on_launcher_gone) if under_a_launcher() else None
        self._launcher_gone = False

    # -- handlers ----------------------------------------------------------------------
    def install(self, global_step: int) -> None:
        """Take over SIGTERM and SIGINT (main thread only: Python's rule for handlers)."""
        if self.distributed:  # the same steps on every rank: a pure function of the step
            self.check_at = (global_step // self.check_every + 1) * self.check_every
        leave_note(TRAINING)  # sailfin launch: steps can be lost from here, unless saved
        if self._launcher is not None:
            self._launcher.start()
        if threading.current_thread() is not threading.main_thread():
            return
        self._pid = os.getpid()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        if self._launcher is not None:
            self._launcher.stop()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:
            # A forked DataLoader worker inherits this handler. SLURM signals every process
            # of the step: the worker keeps serving batches until the trainer stops it.
            return
        name = signal.Signals(signum).name
        now = time.monotonic()
        if signum == signal.SIGINT:
            if self._sigint_at is not None and now - self._sigint_at > _SAME_PRESS_SECONDS:
                self.uninstall()
                raise KeyboardInterrupt  # a second Ctrl-C: abort now, no save
            if self._sigint_at is not None:
                return
            self._sigint_at = now
        if self.signal_name is not None:
            return  # the stop is under way (torchrun forwards the scheduler's SIGTERM again)
        # No I/O here: a print landing while the loop writes to the same stream raises
        # "reentrant call" and ends the run without its save. poll() reports it.
        self.signal_name = name
        if not self.distributed:
            self.check_at = 0  # the loop stops after the step in progress

    def _on_launcher_gone(self, pid: int) -> None:
        """The watch's thread: the launcher exited without stopping this worker (killed
        with SIGKILL): no one supervises the run any more; stop as on a SIGTERM."""
        if self.signal_name is not None:
            return
        self._launcher_gone = True
        self.signal_name = f"the loss of its launcher (pid {pid})"
        if not self.distributed:
            self.check_at = 0

    # -- the loop's question -------------------------------------------------------------
    def save_and_stop(self, trainer: Any) -> None:
        """Every rank: save this step (unless saved already), wait until it is on storage,
        and raise :class:`TrainingPreempted` (the loop calls it once :meth:`poll` said
        stop)."""
        from ..checkpointing.saver import CheckpointCallback

        saver = trainer.saver or CheckpointCallback(trainer.checkpointer,
                                                    trainer.args.checkpoint)
        saver.save(trainer)
        trainer.checkpointer.wait()
        latest = trainer.checkpointer.latest()
        raise TrainingPreempted(self.signal_name or "a signal", trainer.global_step,
                                f"{trainer.checkpointer.location}/{latest}" if latest else None)

    def poll(self, global_step: int) -> bool:
        """True when every rank stops after ``global_step``; with several ranks, one small
        all-reduce, so every rank calls it at the same steps."""
        if not self.distributed:  # polled only once a signal came (check_at 0)
            self._report(global_step)
            return True
        self.check_at = global_step + self.check_every
        if self._launcher is not None:
            self._launcher.check()  # a rank whose watch has not looked yet names it too
        flag = torch.tensor(0.0 if self.signal_name is None else 1.0, device=self.device)
        if self.all_reduce_mean(flag).item() > 0:
            if self.signal_name is None:
                self.signal_name = "SIGTERM (on another rank)"
            else:
                self._report(global_step)
            return True
        return False

    def _report(self, global_step: int) -> None:
        """The signal handler's message, printed from the loop (the handler does no I/O)."""
        if self._launcher_gone:
            return  # the stop's one line (TrainingPreempted) says it all
        where = (f" (step {global_step}: the ranks agree every {self.check_every} steps)"
                 if self.distributed else "")
        say(f"{self.signal_name} received: stopping after this step{where}, "
            "with a checkpoint" + (" (Ctrl-C again to abort without saving)"
                                   if self._sigint_at is not None else ""))
