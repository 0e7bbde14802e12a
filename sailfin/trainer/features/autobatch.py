"""``micro_batch_size: auto``: the largest micro-batch that fits, the global batch untouched
(docs/batch-plan.md). A step that runs out of memory runs again from its first
micro-batch at the next smaller size: the optimizer and schedule have not moved yet.

A rank that runs out of memory must not leave its partners waiting in DDP's gradient
all-reduce: so for a size's first ``PROBE_STEPS`` steps a multi-rank run *probes*:
gradients stay local, one small all-reduce agrees on the smallest size any rank
proposes, then the gradients are averaged in one flat all-reduce. Peak memory comes in
the second step (the first creates the optimizer's state), hence two."""

from __future__ import annotations

import contextlib
import gc
import time
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch

from ...data.plan import BatchPlan
from ...distributed.watchdog import ALL_REDUCE
from ...utils.voice import say
from ..core.callbacks import Callback

if TYPE_CHECKING:
    from ..core.view import RunView


PROBE_STEPS = 2  # steps at a new size during which ranks agree after every step


class MicroBatchError(RuntimeError):
    """No micro-batch fits, or one stopped fitting after the ranks had agreed on it."""


class AutoMicroBatch(Callback):
    """Finds and keeps the micro-batch size for ``trainer.micro_batch_size: auto``, changing
    it through ``trainer.replan``.

    Example::

        auto = AutoMicroBatch(global_batch=64, world_size=2)
        auto.sizes          # (32, 16, 8, 4, 2, 1): tried in this order
    """

    state_key = "auto_micro_batch"

    def __init__(self, global_batch: int, world_size: int, ceiling: Optional[int] = None,
                 rank: int = 0) -> None:
        self.sizes = BatchPlan.micro_batch_sizes(global_batch, world_size, ceiling)
        self.global_batch, self.world_size, self.rank = global_batch, world_size, rank
        self.size = self.sizes[0]
        self.clean_steps = 0          # steps finished at self.size by this process
        self.out_of_memory_steps: list[dict[str, int]] = []  # {"step", "size"}
        self._failed = False
        self.retry_seconds = 0.0      # failed attempts, memory freed, replanned
        self._step_started = 0.0
        self._local: Optional[contextlib.ExitStack] = None
        self._saved: Optional[Mapping[str, Any]] = None

    @property
    def probing(self) -> bool:
        """Ranks agree after every step (several ranks, a size not yet proven)."""
        return self.world_size > 1 and self.clean_steps < PROBE_STEPS

    # -- the run -----------------------------------------------------------------
    def start(self, trainer: "RunView") -> None:
        """After resume: continue with the checkpoint's size if it ran on this world size."""
        saved = self._saved
        if (saved and saved.get("world_size") == self.world_size
                and saved.get("global_batch") == self.global_batch
                and saved.get("size") in self.sizes):
            self.size = int(saved["size"])
            self.out_of_memory_steps = list(saved.get("out_of_memory_steps", []))
            how = "from the checkpoint"
        else:
            how = ("searching again after a resize (the checkpoint's size was for "
                   f"{saved.get('world_size')} ranks)" if saved else "searching from the largest")
        if trainer.plan.micro_batch != self.size:
            trainer.replan(self.size)
        if trainer.dist.is_main:
            say(f"micro_batch_size auto: starting with {self.size} per device ({how}; "
                f"sizes {', '.join(map(str, self.sizes))})")

    # -- the step hooks ------------------------------------------------------------
    def on_step_begin(self, trainer: "RunView") -> None:
        self._step_started = time.perf_counter()  # a failed attempt's time: oom_retries
        if self.probing:
            self._local = contextlib.ExitStack()
            self._local.enter_context(trainer.backend.local_gradients())

    def on_out_of_memory(self, trainer: "RunView") -> None:
        self.out_of_memory(trainer.step_in_epoch, trainer.global_step)

    def out_of_memory(self, step: int, global_step: int) -> None:
        """Called in the trainer's ``except torch.OutOfMemoryError``."""
        if self.world_size > 1 and not self.probing:
            smaller = self._next_size()
            raise MicroBatchError(
                f"rank {self.rank} ran out of memory at step {global_step + 1} with "
                f"micro_batch_size {self.size} (auto), after the ranks had agreed on it; "
                f"ranks only agree during a size's first {PROBE_STEPS} steps, so this run "
                f"cannot retry. Set trainer.micro_batch_size to "
                f"{smaller if smaller else 1} or smaller and resume (inputs that grow, like "
                "longer sequences, need room to spare)") from None
        self._failed = True
        say(f"micro_batch_size auto: rank {self.rank} ran out of memory at step "
            f"{global_step + 1} with micro-batch {self.size}", warning=True)

    def on_backward_end(self, trainer: "RunView", samples: int) -> bool:
        """After the step's micro-batches: True if the step must run again (the trainer
        replanned for a smaller size)."""
        failed, self._failed = self._failed, False
        if self._local is None:  # one process, or a proven size: nothing to agree on
            if not failed:
                self.clean_steps += 1
                if self.clean_steps == 1 and self.world_size == 1:
                    say(f"micro_batch_size auto: {self.size} fits")
                return False
            new = self._next_size()
        else:
            self._local.close()
            self._local = None
            trainer.heartbeat.phase = ALL_REDUCE
            new = trainer.backend.agree_min(self._next_size() if failed else self.size)
            if new == self.size:  # every rank got through: combine the local gradients
                trainer.backend.reduce_gradients(trainer.trainable_params)
                self.clean_steps += 1
                if not self.probing and trainer.dist.is_main:
                    say(f"micro_batch_size auto: {self.size} per device fits on every rank")
                return False
        for opt in trainer.optimizers:  # the failed attempt's gradients go
            opt.zero_grad(set_to_none=True)
        old = self.size
        self.out_of_memory_steps.append({"step": trainer.global_step + 1, "size": old})
        if new == 0:
            raise MicroBatchError(
                f"micro_batch_size auto: even a micro-batch of {old} sample(s) per device "
                f"runs out of memory (step {trainer.global_step + 1}); the model does not fit "
                "this device: use a smaller model, activation_checkpointing, a *-amp "
                "backend, or more memory")
        gc.collect()  # activations held by reference cycles (a traceback's frames)
        if trainer.device.type == "cuda":
            torch.cuda.empty_cache()
        self.size, self.clean_steps = new, 0
        trainer.replan(new)
        if trainer.dist.is_main:
            say(f"micro_batch_size auto: step {trainer.global_step + 1} runs again with "
                f"micro-batch {new} ({old} ran out of memory)")
        self.retry_seconds += time.perf_counter() - self._step_started  # the time account
        return True

    def summary(self) -> dict[str, Any]:
        return {"micro_batch_size": self.size, "tried": list(self.sizes[:self.sizes.index(
            self.size) + 1]), "out_of_memory_steps": list(self.out_of_memory_steps)}

    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "world_size": self.world_size,
                "global_batch": self.global_batch,
                "out_of_memory_steps": list(self.out_of_memory_steps)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._saved = dict(state)  # applied by start(), once the trainer knows its world

    def _next_size(self) -> int:
        """The next smaller size the plan allows; 0 when there is none."""
        i = self.sizes.index(self.size)
        return self.sizes[i + 1] if i + 1 < len(self.sizes) else 0
