"""``load_best_model_at_end``: what a run reports at its end (summary.json's ``val``, the
closing lines) is what an evaluation of final/'s saved weights gives, and it says which
step that model is."""

import json

import pytest
import yaml
from safetensors.torch import load_file

from sailfin.cli import main
from tests.hf.helpers import NO_DROPOUT, write, yaml_config

pytest.importorskip("transformers")


def test_the_figures_reported_are_those_of_the_best_model_final_holds(data_dir, tmp_path,
                                                                      capsys):
    """final/hf held the best checkpoint's model (loss 1.0740 in a user's own evaluation)
    while the closing lines printed the last epoch's validation loss 0.8874."""
    from sailfin import Trainer
    from sailfin.config import load_config

    out = tmp_path / "run"
    cfg = yaml.safe_load(yaml_config("classification", data_dir, out, val_every_n_steps=1,
                                     val_every_n_epochs=0, checkpoint={
                                         "every_n_steps": 1, "best_metric": "loss",
                                         "best_mode": "max"}))  # the worst: an early step
    cfg["module"]["init_args"]["config"].update(NO_DROPOUT["classification"])
    cfg["module"]["init_args"]["load_best_model_at_end"] = True
    path = write(tmp_path / "c.yaml", yaml.safe_dump(cfg))
    assert main(["train", path]) == 0
    captured = capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    best = summary["best"]["step"]
    assert best < summary["global_step"]  # the best is not the last here
    assert summary["final_model"]["step"] == best
    assert summary["final_model"]["checkpoint"].endswith(f"step-{best:08d}")
    said = [line for line in captured.err.splitlines() if "final model:" in line]
    assert len(said) == 1 and f"the checkpoint of step {best}" in said[0], captured.err
    assert "init_from:" not in captured.err  # no new run is starting
    closing = {line.split(": ")[0][len("validation "):]: float(line.split(": ")[1])
               for line in captured.out.splitlines() if line.startswith("validation ")}
    assert closing == {k: pytest.approx(v, abs=5e-5) for k, v in summary["val"].items()}
    assert summary["val"]["loss"] == pytest.approx(summary["best"]["value"], rel=1e-6)

    # An evaluation of its own: final/'s saved weights in a model built afresh.
    run = load_config(path, [])
    module = run.build()
    state = load_file(str(out / "final" / "model.safetensors"))
    assert sorted(state) == sorted(module.state_dict())
    module.load_state_dict(state)
    own = Trainer(module, run.trainer.__class__(**{
        **run.trainer.__dict__, "output_dir": str(tmp_path / "eval"), "writers": [],
        "progress": "none"})).validate()
    own = next(iter(own.values()))
    assert own == {k: pytest.approx(v, rel=1e-6) for k, v in summary["val"].items()}
    # final/hf is the same model.
    hf = load_file(str(out / "final" / "hf" / "model.safetensors"))
    for name, value in hf.items():
        assert (state[f"model.{name}"] == value).all(), name
