"""docs/migrating-from-pymarlin.md names every PyMarlin trainer key and callback."""

from pathlib import Path

import pytest

DOC = (Path(__file__).resolve().parents[1] / "docs" / "migrating-from-pymarlin.md").read_text()

PYMARLIN_TRAINER_KEYS = [
    "epochs", "use_gpu", "train_batch_size", "gpu_batch_size_limit", "val_batch_size",
    "max_train_steps_per_epoch", "max_val_steps_per_epoch", "clip_grads", "max_grad_norm",
    "reset_optimizers_schedulers", "checkpointer_args", "distributed_training_args",
    "writers", "stats_args", "writer_args", "disable_tqdm", "log_level", "backend",
    "amp_backend_native", "amp_backend_apex", "amp_level_apex"]
PYMARLIN_CALLBACKS = ["on_begin_train_epoch", "on_end_train_step", "on_end_backward",
                      "on_end_train_epoch", "on_end_val_epoch", "on_end_train",
                      "get_test_dataloaders"]


@pytest.mark.parametrize("key", PYMARLIN_TRAINER_KEYS)
def test_every_pymarlin_trainer_key_has_a_row(key):
    assert f"\n| `{key}`" in DOC or f"| `{key}` (" in DOC or f", `{key}`" in DOC, key


@pytest.mark.parametrize("name", PYMARLIN_CALLBACKS)
def test_every_pymarlin_callback_has_a_row(name):
    assert f"\n| `{name}" in DOC, name


def test_the_doc_covers_what_the_issue_found_missing():
    for text in ("on_end_train_epoch(global_step, epoch)", "clip_grads: true",
                 "max_grad_norm: 1.0", "getlogger", "trainer.dist", "CustomArgParser",
                 "multi_process_data(inputs, *args, process_count=N)", "resume_config accept",
                 "init_from", "examples/cifar_pymarlin"):
        assert text in DOC, text


def test_the_doc_covers_the_data_pipeline_and_pymarlins_forms():
    """(#28) process_data, setup_datasets and __main__ have replacements, with a
    before/after text-classification recipe; the PyMarlin forms are described as accepted."""
    for text in ("`DataInterface.process_data(processor, *args)`", "`DataInterface.setup_datasets()`",
                 "`__main__`", "once per sample of\n  its batch",
                 "def on_end_val_epoch(self, global_step, *inputs, key=\"default\")"):
        assert text in DOC, text
