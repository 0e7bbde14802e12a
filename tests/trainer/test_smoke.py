import json

from sailfin import Trainer

from tests.recipes import IdData, LinearRecipe, args


def test_trains_and_writes_outputs(tmp_path):
    module = LinearRecipe(IdData(100, 30))
    summary = Trainer(module, args(tmp_path, epochs=2)).train()
    assert summary["global_step"] == 20
    assert summary["samples_seen"] == 200
    assert (tmp_path / "final" / "model.safetensors").exists()
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["val"]["count"] == 30
