"""``sailfin export CHECKPOINT OUT`` and ``load_best_model_at_end``: a save_pretrained
directory from any checkpoint (best, last, sharded), loadable with from_pretrained."""

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from sailfin.cli import main
from tests.hf.helpers import NO_DROPOUT, yaml_config, write

transformers = pytest.importorskip("transformers")
Auto = transformers.AutoModelForSequenceClassification


def config(data_dir, out, module=None, **trainer):
    cfg = yaml.safe_load(yaml_config("classification", data_dir, out, **trainer))
    cfg["module"]["init_args"]["config"].update(NO_DROPOUT["classification"])
    cfg["module"]["init_args"].update(module or {})
    return yaml.safe_dump(cfg)


def weights(path):
    """The model's tensors of a save_pretrained directory, or of final/model.safetensors
    (less its ``model.`` prefix)."""
    if path.is_dir():
        return load_file(str(path / "model.safetensors"))
    return {k[len("model."):]: v for k, v in load_file(str(path)).items()}


def assert_same(a, b):
    shared = a.keys() & b.keys()
    assert len(shared) >= 8
    for k in shared:
        assert torch.equal(a[k], b[k]), k


def test_load_best_model_at_end_and_export_of_the_best_and_the_last(data_dir, tmp_path,
                                                                     capsys):
    out = tmp_path / "run"
    text = config(data_dir, out, module={"load_best_model_at_end": True},
                  val_every_n_steps=1, val_every_n_epochs=0,
                  checkpoint={"every_n_steps": 1, "best_metric": "loss", "best_mode": "max"})
    assert main(["train", write(tmp_path / "c.yaml", text)]) == 0
    best = (out / "checkpoints" / "best").read_text().strip()
    summary = json.loads((out / "summary.json").read_text())
    assert best != f"step-{summary['global_step']:08d}"  # the best is not the last here
    assert main(["export", str(out / "checkpoints" / best), str(tmp_path / "best")]) == 0
    assert main(["export", str(out / "checkpoints"), str(tmp_path / "last")]) == 0  # latest
    assert "exported" in capsys.readouterr().out
    # final/hf and final/model.safetensors hold the best checkpoint's weights; the latest
    # checkpoint (the last step's state, saved before the best was put in place) the last.
    assert_same(weights(out / "final" / "hf"), weights(tmp_path / "best"))
    assert_same(weights(out / "final" / "model.safetensors"), weights(tmp_path / "best"))
    last, hf = weights(tmp_path / "last"), weights(out / "final" / "hf")
    assert any(not torch.equal(last[k], hf[k]) for k in last.keys() & hf.keys())
    for name in ("best", "last"):
        model = Auto.from_pretrained(tmp_path / name)
        assert model.config.id2label and (tmp_path / name / "tokenizer.json").exists()


def test_load_best_model_at_end_without_a_best_metric_stops_before_step_1(data_dir, tmp_path,
                                                                          capsys):
    text = config(data_dir, tmp_path / "run", module={"load_best_model_at_end": True})
    assert main(["train", write(tmp_path / "c.yaml", text)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs trainer.checkpoint.best_metric" in err[0]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_export_of_a_run_without_a_recorded_recipe_says_what_to_do(data_dir, tmp_path,
                                                                    capsys):
    from tests.hf.helpers import train

    train("classification", data_dir, tmp_path / "run", max_steps=1,
          checkpoint={"every_n_steps": 1})
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run" / "checkpoints"), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "records no module: section" in err[0]
    assert "save_pretrained_from" in err[0]


@pytest.mark.slow
def test_export_of_an_fsdp_checkpoint_loads_with_from_pretrained(data_dir, tmp_path):
    from tests.distributed.harness import errors, run_ranks
    from tests.hf.fsdp_worker import export_rank

    out = tmp_path / "run"
    text = config(data_dir, out, backend="fsdp", micro_batch_size=2, max_steps=2,
                  checkpoint={"every_n_steps": 2})
    codes = run_ranks(export_rank, 2, tmp_path, timeout=180, config_text=text)
    assert codes == [0, 0], errors(tmp_path)
    assert main(["export", str(out / "checkpoints"), str(tmp_path / "exported")]) == 0
    assert_same(weights(out / "final" / "model.safetensors"), weights(tmp_path / "exported"))
    assert Auto.from_pretrained(tmp_path / "exported").config.model_type == "bert"


def test_export_of_a_lora_checkpoint_is_the_adapter_final_hf_holds(data_dir, tmp_path):
    pytest.importorskip("peft")
    out = tmp_path / "run"
    text = config(data_dir, out, module={"peft": {"r": 4, "lora_alpha": 8}}, max_steps=2,
                  checkpoint={"every_n_steps": 2, "at_epoch_end": False})
    assert main(["train", write(tmp_path / "c.yaml", text)]) == 0
    assert main(["export", str(out / "checkpoints"), str(tmp_path / "exported")]) == 0
    exported = load_file(str(tmp_path / "exported" / "adapter_model.safetensors"))
    final = load_file(str(out / "final" / "hf" / "adapter_model.safetensors"))
    assert exported.keys() == final.keys() and any("lora_B" in k for k in final)
    assert_same(exported, final)
    assert (tmp_path / "exported" / "adapter_config.json").exists()
