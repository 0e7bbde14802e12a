"""benchmarks/hf.py's arms run on a few rows: sailfin, HF Trainer and the plain loop (the
floor) each train the same model and report their loop time and accuracy."""

import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))

pytestmark = pytest.mark.slow  # fresh processes that import transformers


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    import hf

    work = str(tmp_path_factory.mktemp("hf"))
    saved = (hf.TRAIN_ROWS, hf.VAL_ROWS, hf.EPOCHS)
    hf.TRAIN_ROWS, hf.VAL_ROWS, hf.EPOCHS = 96, 32, 1
    try:
        paths = hf.prepare(work)
        env = {**os.environ,
               "PYTHONPATH": hf.ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        yield hf, paths, work, env
    finally:
        hf.TRAIN_ROWS, hf.VAL_ROWS, hf.EPOCHS = saved


@pytest.mark.parametrize("arm", ["sailfin", "hf", "floor"])
def test_each_arm_trains_the_model_and_reports_its_loop(prepared, arm):
    if arm == "hf" and importlib.util.find_spec("accelerate") is None:
        pytest.skip("HF Trainer needs accelerate: pip install -e '.[bench]'")
    hf, paths, work, env = prepared
    before = set(os.listdir(work))
    got = {"sailfin": hf.run_sailfin, "hf": hf.run_hf, "floor": hf.run_floor}[arm](
        paths, work, env)
    assert got["command_s"] > got["loop_s"] > 0
    assert 0.0 <= got["accuracy"] <= 1.0
    (out,) = set(os.listdir(work)) - before  # the run's own directory
    saved = (os.path.join(work, out, "run", "final", "hf") if arm == "sailfin"
             else os.path.join(work, out, "final"))
    assert os.path.isfile(os.path.join(saved, "config.json"))  # the trained model, saved


@pytest.mark.parametrize("arm", ["sailfin", "hf", "floor", "sailfin-full"])
def test_peft_arms_train_lora_on_a_llama_and_report_peak_memory(prepared_peft, arm):
    """--peft --model llama: every arm trains LoRA adapters on the same Llama-shaped
    model (sailfin-full: the full fine-tune LoRA's memory is measured against)."""
    hf, paths, work, env = prepared_peft
    if arm == "hf" and importlib.util.find_spec("accelerate") is None:
        pytest.skip("HF Trainer needs accelerate: pip install -e '.[bench]'")
    before = set(os.listdir(work))
    got = {"sailfin": hf.run_sailfin, "hf": hf.run_hf, "floor": hf.run_floor,
           "sailfin-full": hf.run_sailfin_full}[arm](paths, work, env)
    assert got["command_s"] > got["loop_s"] > 0 and got["peak_bytes"] > 0
    (out,) = set(os.listdir(work)) - before
    if arm.startswith("sailfin"):
        final = os.path.join(work, out, "run", "final", "hf")
        adapter = os.path.isfile(os.path.join(final, "adapter_config.json"))
        assert adapter == (arm == "sailfin")  # LoRA writes an adapter; full, the model


@pytest.fixture(scope="module")
def prepared_peft(tmp_path_factory):
    pytest.importorskip("peft")
    import hf

    work = str(tmp_path_factory.mktemp("hf-peft"))
    saved = (hf.TRAIN_ROWS, hf.VAL_ROWS, hf.EPOCHS, hf.MODEL, dict(hf.EXTRA))
    hf.TRAIN_ROWS, hf.VAL_ROWS, hf.EPOCHS = 64, 32, 1
    hf.MODEL, hf.EXTRA["peft"] = hf.llama(64, 2), dict(hf.PEFT)
    try:
        paths = hf.prepare(work)
        env = {**os.environ,
               "PYTHONPATH": hf.ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        yield hf, paths, work, env
    finally:
        hf.TRAIN_ROWS, hf.VAL_ROWS, hf.EPOCHS, hf.MODEL = saved[:4]
        hf.EXTRA.clear()
        hf.EXTRA.update(saved[4])
