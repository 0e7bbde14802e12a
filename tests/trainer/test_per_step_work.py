"""sailfin's own Python work per optimizer step stays at its recorded figure.

A small recipe trains with the default writers and features twice, for a short and a
long run; (long - short) / (steps between) is the work per step, set-up and the final
files cancelling out. Counted, not timed (``benchmarks/_bytecodes.py``, ``OwnWork``): the
calls of sailfin's own functions per step, the same on every Python version, and the
lines they run per step, recorded per Python version (each reports a few constructs its
own way). A change that adds work to every step fails here by more than
:data:`TOLERANCE`, and says so in review; if the growth is intended, record the new
figures (the failure says how) and say why in the commit.

    PYTHONPATH=. python tests/trainer/test_per_step_work.py --record
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import sys
import tempfile

import pytest
import torch
from torch import nn

import sailfin
from sailfin import DataInterface, ModuleInterface, Trainer, TrainerArguments

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "benchmarks"))
from _bytecodes import OwnWork, own_per_step  # noqa: E402

RECORD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "per_step_work.json")
TOLERANCE = 0.03  # growth over the recorded figure that fails
SHORT, LONG = 20, 60  # steps of the two runs
# name -> (global batch, micro-batch): one micro-batch per step, and two (accumulation).
SHAPES = {"one_micro_batch": (8, 8), "two_micro_batches": (8, 4)}
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
UPDATE = "PYTHONPATH=. python tests/trainer/test_per_step_work.py --record"
_warm: set[str] = set()  # the shapes trained once in this process


class Data(DataInterface):
    def __init__(self, steps: int, batch: int) -> None:
        g = torch.Generator().manual_seed(0)
        n = steps * batch
        self.ds = torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g),
                                                 torch.randint(0, 3, (n,), generator=g))

    def get_train_dataset(self):
        return self.ds


class Tiny(ModuleInterface):
    def __init__(self, data: Data) -> None:
        super().__init__()
        self.data = data
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [torch.optim.SGD(self.parameters(), lr=0.01)], []

    def train_step(self, global_step, batch, device):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x.to(device)), y.to(device))


def train(steps: int, batch: int, micro: int, out: str, callbacks: tuple = ()) -> None:
    """One epoch of ``steps`` steps with the defaults a user gets (stdout and
    metrics.jsonl, a checkpoint at the epoch's end, the time account), progress as
    lines (a terminal's bar would be another figure), no validation data."""
    args = TrainerArguments(epochs=1, train_batch_size=batch, micro_batch_size=micro,
                            output_dir=out, progress="lines", checkpoint={"at_epoch_end": False})
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        trainer = Trainer(Tiny(Data(steps, batch)), args, callbacks=list(callbacks))
        try:
            trainer.train()
        finally:
            trainer.close()


@functools.lru_cache(maxsize=None)
def per_step(shape: str, callbacks: tuple = ()) -> dict:
    """Calls and lines per step (``own_per_step``) of a run of ``shape``."""
    batch, micro = SHAPES[shape]
    root = os.path.dirname(sailfin.__file__)
    with tempfile.TemporaryDirectory() as tmp:
        if shape not in _warm:  # lazy imports, the plan's cached micro-batches of this
            train(SHORT, batch, micro, os.path.join(tmp, "warm"))  # shape: not per step
            _warm.add(shape)
        short, long = (OwnWork.measure(lambda n=n: train(n, batch, micro,
                                                          os.path.join(tmp, str(n)),
                                                          callbacks), root)
                       for n in (SHORT, LONG))
    return own_per_step(short, long, LONG - SHORT)


def figures() -> dict[str, dict[str, float]]:
    return {shape: per_step(shape) for shape in SHAPES}


def read_record() -> dict:
    with open(RECORD, encoding="utf-8") as fh:
        return json.load(fh)


def grown(measured: float, recorded: float) -> bool:
    return measured > recorded * (1 + TOLERANCE) + 1e-9


def top(by_function: dict, n: int = 12) -> str:
    rows = sorted(by_function.items(), key=lambda kv: -kv[1])[:n]
    return "\n".join(f"  {v:8.2f}  {path} {fn}" for (path, fn), v in rows)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_sailfins_work_per_step_stays_at_its_recorded_figure(shape):
    record = read_record()
    work = per_step(shape)
    calls = record["calls"][shape]
    lines = record["lines"].get(PYTHON, {}).get(shape)  # None: not recorded on this Python
    how = (f"If the growth is intended, record the new figures with `{UPDATE}` (on each "
           f"Python version you have) and say in the commit what the step does more.")
    assert not grown(work["calls"], calls), (
        f"sailfin's work per step grew ({shape}): {work['calls']:.2f} calls of its "
        f"functions per step, recorded {calls:.2f} ({work['calls'] / calls - 1:+.1%}, "
        f"limit +{TOLERANCE:.0%}). Calls per step by function:\n{top(work['by_function'])}\n"
        + how)
    if lines is not None:
        assert not grown(work["lines"], lines), (
            f"sailfin's work per step grew ({shape}, Python {PYTHON}): {work['lines']:.2f} "
            f"lines per step, recorded {lines:.2f} ({work['lines'] / lines - 1:+.1%}, limit "
            f"+{TOLERANCE:.0%}). Lines per step by function:\n"
            f"{top(work['lines_by_function'])}\n" + how)


def test_the_count_sees_one_more_call_per_step():
    """The figure can fail: a callback that does nothing but is called every step adds
    one call per step (of sailfin's: the callback lives in the package for this)."""
    from sailfin.trainer.core.callbacks import Callback

    # on_step_end: a sailfin function that does nothing (Callback's own on_train_start).
    every_step = type("EveryStep", (Callback,), {"on_step_end": Callback.on_train_start})
    base = per_step("one_micro_batch")
    more = per_step("one_micro_batch", (every_step(),))
    assert more["calls"] == pytest.approx(base["calls"] + 1), (base["calls"], more["calls"])


def record() -> None:
    """Write this Python's figures into the record (calls: the same on every version)."""
    data = read_record() if os.path.exists(RECORD) else {"calls": {}, "lines": {}}
    measured = figures()
    data["calls"] = {shape: round(w["calls"], 2) for shape, w in measured.items()}
    data["lines"][PYTHON] = {shape: round(w["lines"], 2) for shape, w in measured.items()}
    data["lines"] = dict(sorted(data["lines"].items()))
    with open(RECORD, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")
    print(json.dumps(data, indent=2))


if __name__ == "__main__":
    if sys.argv[1:] == ["--record"]:
        record()
    else:
        for shape, work in figures().items():
            print(f"{shape}: {work['calls']:.2f} calls, {work['lines']:.2f} lines per step")
            print(top(work["lines_by_function"], 40))
