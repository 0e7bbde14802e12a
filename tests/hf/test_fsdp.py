"""fsdp over 2 gloo processes: units from the model, the same training as one process,
validation gathered once, final/hf/ written once from the gathered weights."""

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.harness import errors, run_ranks
from tests.hf.fsdp_worker import train_rank
from tests.hf.helpers import NO_DROPOUT, train

transformers = pytest.importorskip("transformers")

TRAINER = dict(max_steps=3, train_batch_size=8, micro_batch_size=2, val_every_n_epochs=1,
               val_batch_size=8)
# The model's _no_split_modules: BertEmbeddings and BertLayer; GPT2Block.
UNITS = {"classification": {"model.bert.embeddings", "model.bert.encoder.layer.0",
                            "model.bert.encoder.layer.1"},
         "causal_lm": {"model.transformer.h.0", "model.transformer.h.1"}}
pytestmark = pytest.mark.slow  # about a minute each on 2 busy cores


@pytest.mark.parametrize("task", ["classification", "causal_lm"])
def test_fsdp_on_two_processes_matches_one(task, data_dir, tmp_path):
    # Dropout off: one process and two draw different masks.
    ref, _, ref_summary = train(task, data_dir, tmp_path / "sp",
                                module_kw={"config_kw": NO_DROPOUT[task]},
                                **{**TRAINER, "micro_batch_size": 8})
    out = tmp_path / "fsdp"
    out.mkdir()
    codes = run_ranks(train_rank, 2, out, timeout=180, task=task, data_dir=data_dir,
                      trainer=TRAINER)
    assert codes == [0, 0], errors(out)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert set(ranks[0]["units"]) == UNITS[task]
    # No rank holds the whole model.
    assert ranks[0]["held"] + ranks[1]["held"] == ranks[0]["total"]
    assert max(r["held"] for r in ranks) < 0.6 * ranks[0]["total"]
    # Gathered once: both ranks report the metrics of the whole validation set, as sp.
    assert ranks[0]["summary"]["val"] == ranks[1]["summary"]["val"]
    for key, value in ref_summary["val"].items():
        assert ranks[0]["summary"]["val"][key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    final = load_file(str(out / "run" / "final" / "hf" / "model.safetensors"))
    for key, value in ref.model.state_dict().items():
        if key in final:
            torch.testing.assert_close(final[key], value, rtol=1e-4, atol=1e-5)
    loaded = transformers.AutoConfig.from_pretrained(out / "run" / "final" / "hf")
    assert loaded.model_type == ref.model.config.model_type
