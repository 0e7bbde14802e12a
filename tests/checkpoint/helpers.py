"""Recipes, checkpointers and file helpers for the checkpoint tests (also used by subprocesses)."""

from __future__ import annotations

import json
import os
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


class SlowCheckpointer(DirectoryCheckpointer):
    """Pauses after writing trainer.pt (the shards are written by then) when SAILFIN_TEST_SAVE_PAUSE is set (only for step
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

    def write_file(self, path, obj):
        entry = super().write_file(path, obj)
        pause = float(os.environ.get("SAILFIN_TEST_SAVE_PAUSE", "0"))
        marker_dir = os.environ.get("SAILFIN_TEST_SAVE_MARKER")
        only = os.environ.get("SAILFIN_TEST_SAVE_PAUSE_STEP")
        step = int(os.path.basename(os.path.dirname(path)).rsplit("-", 1)[1])
        if (pause and marker_dir and os.path.basename(path) == "trainer.pt"
                and (only is None or int(only) == step)):
            Path(marker_dir, f"saving-{step}").write_text(path)
            time.sleep(pause)
        return entry


class FailingCheckpointer(DirectoryCheckpointer):
    """Raises while writing ``fail_file`` of the save at ``fail_step`` (a crash mid-save)."""

    fail_step = -1
    fail_file = "trainer.pt"

    def write_file(self, path, obj):
        # The step from the path: with async saves, this runs in the writer thread.
        if (f"step-{self.fail_step:08d}" in path
                and os.path.basename(path) == self.fail_file):
            raise OSError(28, "No space left on device (simulated)")
        return super().write_file(path, obj)


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


def metric_lines(output_dir) -> list[dict]:
    """metrics.jsonl without the timing field (the only one that differs between runs)."""
    lines = Path(output_dir, "metrics.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    for e in events:
        for timed in ("samples_per_second", "tflops", "mfu"):  # depend on the clock
            e.pop(timed, None)
    return events


class Rank1DiskFull(FailingCheckpointer):
    """Rank 1's own file of step 2's save meets a full disk (rank 0's does not)."""

    fail_step = 2
    fail_file = "rng-rank00001.pt"


class Rank0DiskFull(FailingCheckpointer):
    """Rank 0's trainer.pt of step 2's save meets a full disk, in its commit alone."""

    fail_step = 2
    fail_file = "trainer.pt"
