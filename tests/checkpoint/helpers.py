"""Recipes, checkpointers and file helpers for the checkpoint tests (also used by subprocesses)."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from sailfin.checkpoint import DirectoryCheckpointer
from sailfin.trainer.core.callbacks import Callback
from tests.recipes import LinearRecipe


class SlowLinear(LinearRecipe):
    """LinearRecipe whose steps take ``step_seconds``: a process can be killed mid-run."""

    def __init__(self, data, dim: int = 4, lr: float = 0.05, dropout: float = 0.0,
                 momentum: float = 0.0, step_seconds: float = 0.0) -> None:
        super().__init__(data, dim, lr, dropout, momentum)
        self.step_seconds = step_seconds

    def train_step(self, global_step, batch, device):
        if self.step_seconds:
            time.sleep(self.step_seconds)
        return super().train_step(global_step, batch, device)


class Counting(LinearRecipe):
    """Carries a counter through get_state/update_state."""

    def __init__(self, data, **kw) -> None:
        super().__init__(data, **kw)
        self.counter = 0

    def on_end_train_step(self, global_step, loss, stats):
        super().on_end_train_step(global_step, loss, stats)
        self.counter += 1

    def get_state(self):
        return {"counter": self.counter, "history": torch.arange(3)}

    def update_state(self, state):
        self.counter = state["counter"]


class ScriptedMetric(LinearRecipe):
    """Validation reports ``score`` values from a script, one per validation."""

    def __init__(self, data, scores=(), **kw) -> None:
        super().__init__(data, **kw)
        self.scores = list(scores)
        self.validations = 0

    def on_end_val_epoch(self, global_step, outputs, key="val"):
        metrics = super().on_end_val_epoch(global_step, outputs, key)
        metrics["score"] = self.scores[self.validations]
        self.validations += 1
        return metrics

    def get_state(self):
        return {"validations": self.validations}

    def update_state(self, state):
        self.validations = state["validations"]


def before_writing(writer, hook):
    """``writer`` (a DCP storage writer) calling ``hook()`` before it writes its files."""
    write_data = writer.write_data

    def hooked(plan, planner):
        hook()
        return write_data(plan, planner)
    writer.write_data = hooked
    return writer


def step_of(path) -> int:
    """The step of the save whose staging directory holds ``path``."""
    return int(re.search(r"step-(\d+)", str(path)).group(1))


class SlowCheckpointer(DirectoryCheckpointer):
    """Pauses before the manifest (every rank's shards, small state included, are written
    by then) when SAILFIN_TEST_SAVE_PAUSE is set (only for step
    SAILFIN_TEST_SAVE_PAUSE_STEP if set), and first leaves a marker ``saving-<step>`` in
    SAILFIN_TEST_SAVE_MARKER: a test can kill the process in the middle of a save. It also
    records its last save in ``<marker dir>/custom-checkpointer.json``, so a test can see
    that this class was used."""

    def save(self, snapshot):
        marker_dir = os.environ.get("SAILFIN_TEST_SAVE_MARKER")
        if marker_dir:
            Path(marker_dir, "custom-checkpointer.json").write_text(
                json.dumps({"class": type(self).__name__, "last_step": snapshot.step}))
        super().save(snapshot)

    def commit(self, name, staging, files, request):
        pause = float(os.environ.get("SAILFIN_TEST_SAVE_PAUSE", "0"))
        marker_dir = os.environ.get("SAILFIN_TEST_SAVE_MARKER")
        only = os.environ.get("SAILFIN_TEST_SAVE_PAUSE_STEP")
        if pause and marker_dir and (only is None or int(only) == request.step):
            Path(marker_dir, f"saving-{request.step}").write_text(staging)
            time.sleep(pause)
        super().commit(name, staging, files, request)


class FailingCheckpointer(DirectoryCheckpointer):
    """The save at ``fail_step`` meets a full disk (a crash mid-save): rank ``fail_rank``'s
    shards, or with ``fail_rank`` None rank 0's commit (the manifest)."""

    fail_step = -1
    fail_rank: "int | None" = 0

    def shard_writer(self, path):
        def fail():
            if step_of(path) == self.fail_step and self.dist.rank == self.fail_rank:
                raise OSError(28, "No space left on device (simulated)")
        return before_writing(super().shard_writer(path), fail)

    def commit(self, name, staging, files, request):
        if request.step == self.fail_step and self.fail_rank is None:
            raise OSError(28, "No space left on device (simulated)")
        super().commit(name, staging, files, request)


class CrashAt(Callback):
    """Raises after optimizer step ``step``: an in-process kill. Trainer callbacks run
    before the checkpoint callback, so step ``step`` itself is not saved."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer):
        if trainer.global_step == self.step:
            raise Crash(f"crash at step {self.step}")


class Crash(Exception):
    pass


def params(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same_params(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"parameter {k} differs"


def final_weights(output_dir) -> dict[str, torch.Tensor]:
    return load_file(str(Path(output_dir) / "final" / "model.safetensors"))


def saved_model(step_dir, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model weights a checkpoint holds (its DCP shards), read back with torch alone
    into tensors shaped as ``like``."""
    import torch.distributed.checkpoint as dcp

    state = {"module": {k: torch.empty_like(v) for k, v in like.items()}}
    dcp.load(state, checkpoint_id=str(Path(step_dir) / "shards"), no_dist=True)
    return state["module"]


def small_state(step_dir):
    """(trainer state, rank 0's random streams) of a checkpoint: its small entries, read
    as a resume reads them."""
    from sailfin.config import CheckpointArguments
    from sailfin.distributed import DistEnv

    step_dir = Path(step_dir)
    loaded = DirectoryCheckpointer(str(step_dir.parent), CheckpointArguments(),
                                   DistEnv()).load(step_dir.name)
    return loaded.shared["trainer"], loaded.rank_state


def metric_lines(output_dir) -> list[dict]:
    """metrics.jsonl without the timing field (the only one that differs between runs)."""
    lines = Path(output_dir, "metrics.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    for e in events:
        for timed in ("samples_per_second", "tflops", "mfu"):  # depend on the clock
            e.pop(timed, None)
    return events


class Rank1DiskFull(FailingCheckpointer):
    """Rank 1's shards of step 2's save meet a full disk (rank 0's do not)."""

    fail_step = 2
    fail_rank = 1


class Rank0DiskFull(FailingCheckpointer):
    """Rank 0's manifest of step 2's save meets a full disk, in its commit alone."""

    fail_step = 2
    fail_rank = None
