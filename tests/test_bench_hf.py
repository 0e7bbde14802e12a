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
