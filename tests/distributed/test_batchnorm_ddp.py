"""Reported is saved (BatchNorm): under ddp and fsdp each rank's forwards update its own
running statistics, while the saved model holds rank 0's. Validation must use the saved
ones: the validation loss a run reports equals the loss of its saved final weights
evaluated alone. 2 CPU processes, gloo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from sailfin import Trainer
from sailfin.config import ConfigError
from tests.distributed.harness import errors, run_ranks
from tests.recipes import IdData, LinearRecipe, args


class BatchNormMLP(LinearRecipe):
    """An MLP with BatchNorm1d: its running statistics depend on the batches it saw."""

    def __init__(self, data: IdData, dim: int = 4) -> None:
        super().__init__(data, dim=dim, lr=0.05)
        del self.linear  # unused here: DDP would wait for its gradients
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(dim, 16), nn.BatchNorm1d(16), nn.ReLU(),
                                 nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


DATA = {"n_train": 120, "n_val": 30}


def train_rank(rank: int, world: int, dist_args, out: Path, backend: str) -> None:
    module = BatchNormMLP(IdData(**DATA))
    a = args(out / "run", backend=backend, distributed=dist_args, epochs=2,
             train_batch_size=20, micro_batch_size=10, val_batch_size=8)
    with Trainer(module, a) as trainer:
        trainer.end_process_on_hang = True
        trainer.train()


def saved_model_mse(run: Path) -> float:
    """The saved final weights, evaluated alone on the whole validation set."""
    module = BatchNormMLP(IdData(**DATA))
    module.load_state_dict(load_file(str(run / "final" / "model.safetensors")))
    module.eval()
    errors_ = []
    with torch.no_grad():
        for i in range(len(module.data.val)):
            _, x, y = module.data.val[i]
            errors_.append(float((module(x.unsqueeze(0))[0] - y) ** 2))
    return sum(errors_) / len(errors_)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_the_reported_validation_loss_is_the_saved_models(tmp_path, backend):
    out = tmp_path / backend
    out.mkdir()
    codes = run_ranks(train_rank, 2, out, timeout=240, backend=backend)
    assert codes == [0, 0], errors(out)
    run = out / "run"
    reported = json.loads((run / "summary.json").read_text())["val"]["mse"]
    # Each rank saw other batches: their statistics differed before validation.
    assert reported == pytest.approx(saved_model_mse(run), rel=1e-5, abs=1e-7)


def test_sync_batchnorm_on_cpu_is_refused_in_one_line(tmp_path):
    from sailfin.backends import build_backend
    from sailfin.distributed import DistEnv

    from sailfin.config.distributed import DistArguments

    a = args(tmp_path, backend="ddp", distributed=DistArguments(sync_batchnorm=True),
             device="cpu")
    with pytest.raises(ConfigError,
                       match=r"^trainer.distributed.sync_batchnorm: true needs a CUDA device"):
        build_backend(a, DistEnv(rank=0, world_size=2, launcher="manual"))


def test_sync_batchnorm_under_sp_changes_nothing_and_says_so(tmp_path, caplog):
    from sailfin.config.distributed import DistArguments

    module = BatchNormMLP(IdData(**DATA))
    with caplog.at_level("WARNING", logger="sailfin"):
        Trainer(module, args(tmp_path, distributed=DistArguments(sync_batchnorm=True),
                             epochs=1, train_batch_size=20)).train()
    assert isinstance(module.net[1], nn.BatchNorm1d)
    assert not isinstance(module.net[1], nn.SyncBatchNorm)
    assert caplog.text.count("trainer.distributed.sync_batchnorm: true changes nothing on a "
                             "single process (sp)") == 1


def test_sync_batchnorm_converts_the_layers_in_place_under_ddp():
    """The conversion ddp/fsdp do before wrapping (the training forward itself needs CUDA):
    every BatchNorm becomes a SyncBatchNorm holding the same parameters and buffers."""
    from sailfin.backends.ddp import DDPStrategy
    from sailfin.backends.precision import Precision
    from sailfin.distributed import DistEnv

    module = BatchNormMLP(IdData(**DATA))
    norm = module.net[1]
    strategy = DDPStrategy(Precision(), torch.device("cpu"),
                           DistEnv(rank=0, world_size=2, launcher="manual"))
    strategy.convert_batchnorm(module)
    assert type(module.net[1]) is nn.SyncBatchNorm
    assert module.net[1].weight is norm.weight and module.net[1].running_mean is norm.running_mean
