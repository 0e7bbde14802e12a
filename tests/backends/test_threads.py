"""sp on CPU chooses its intra-op threads and says it once: trainer.threads, else
OMP_NUM_THREADS, else torch's count up to the CPUs the process may use."""

from __future__ import annotations

import logging

import pytest
import torch

from sailfin import ModuleInterface, TrainerArguments
from sailfin.backends import build_backend
from sailfin.backends.strategy import usable_cpus
from sailfin.config import ConfigError
from sailfin.distributed import DistEnv


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


class Tiny(ModuleInterface):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(2, 2)


def set_up(caplog, **kw) -> list[str]:
    """What the backend chose, in words (Trainer.train says it as training starts)."""
    backend = build_backend(TrainerArguments(device="cpu", **kw), DistEnv())
    backend.setup(Tiny())
    return [backend.threads_note]


@pytest.mark.parametrize("backend", ["sp", "sp-amp"])
def test_trainer_threads_sets_the_count_and_says_it_once(caplog, monkeypatch, backend):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # trainer.threads wins over it
    torch.set_num_threads(2)
    said = set_up(caplog, backend=backend, threads=1)
    assert torch.get_num_threads() == 1
    assert said == ["SP on CPU: 1 intra-op thread(s) (trainer.threads)"]


def test_omp_num_threads_is_kept(caplog, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    said = set_up(caplog)
    assert torch.get_num_threads() == 1 and said == [
        "SP on CPU: 1 intra-op thread(s) (OMP_NUM_THREADS=1)"]


def test_the_default_never_exceeds_the_usable_cpus(caplog, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(usable_cpus() + 3)
    said = set_up(caplog)
    assert torch.get_num_threads() == usable_cpus()
    assert len(said) == 1 and f"{usable_cpus()} usable CPU(s)" in said[0]


def test_a_thread_count_below_one_is_a_config_error():
    with pytest.raises(ConfigError, match="trainer.threads"):
        TrainerArguments(threads=0)


def test_training_says_it_once_as_it_starts(tmp_path, caplog):
    from sailfin import Trainer
    from tests.after.recipe import PositionClassifier, PositionData

    args = TrainerArguments(epochs=1, train_batch_size=16, output_dir=str(tmp_path),
                            writers=[], progress="none", threads=1, device="cpu")
    with caplog.at_level(logging.INFO, logger="sailfin"):
        with Trainer(PositionClassifier(PositionData()), args) as trainer:
            trainer.train()
    said = [r.getMessage() for r in caplog.records if "intra-op" in r.getMessage()]
    assert said == ["SP on CPU: 1 intra-op thread(s) (trainer.threads)"]
    assert torch.get_num_threads() == 1
