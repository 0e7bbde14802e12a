"""LoRA by YAML (module.init_args.peft): only the adapters (and the head) train, the
model learns, final/hf is an adapter directory PeftModel loads (or the merged model),
DP-LoRA's epsilon is Opacus's, a crash and resume ends bit-identical."""

import json

import pytest
import torch

from sailfin.cli import main
from sailfin.hf import HFConfigError
from tests.checkpoint.helpers import Crash, CrashAt, assert_same_params, params
from tests.hf.helpers import CONFIGS, NO_DROPOUT, data, train, write, yaml_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0}
LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
         "max_position_embeddings": 64}
T5 = {"model_type": "t5", "d_model": 32, "d_ff": 64, "d_kv": 16, "num_layers": 2,
      "num_decoder_layers": 2, "num_heads": 2, "dropout_rate": 0.0}


def batch_of(m, n=4):
    return m.data.collate([m.data.datasets["val"][i] for i in range(n)])


def base_dir(task, data_dir, tmp_path):
    """A save_pretrained directory of a tiny model of the task (its initial weights)."""
    import sailfin.hf as hf
    from tests.hf.helpers import MODULES

    torch.manual_seed(0)
    m = getattr(hf, MODULES[task])(data(task, data_dir), config=dict(CONFIGS[task]))
    path = tmp_path / "base"
    m.model.save_pretrained(path)
    return path


def grads_after_one_backward(m):
    m.zero_grad(set_to_none=True)
    m.train_step(0, batch_of(m), torch.device("cpu")).backward()
    return {n for n, p in m.named_parameters() if p.grad is not None}


def build(task, data_dir, **kw):
    from sailfin import seed_everything
    from tests.hf.helpers import module

    seed_everything(0)
    return module(task, data_dir, **kw)


def fit(m, out, **kw):
    from sailfin import Trainer
    from tests.hf.helpers import args

    return Trainer(m, args(out, **kw)).train()


@pytest.mark.parametrize("task", ["classification", "causal_lm", "seq2seq"])
def test_only_adapters_and_head_have_gradients_and_the_frozen_base_stays(task, data_dir,
                                                                        tmp_path):
    m = build(task, data_dir, peft=LORA)
    assert m.checkpoint_frozen_params is False
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "modules_to_save" in n for n in trainable)
    if task == "classification":  # peft's SEQ_CLS keeps the new head trainable
        assert any("classifier.modules_to_save" in n for n in trainable)
    assert grads_after_one_backward(m) == trainable
    frozen = {n: p.detach().clone() for n, p in m.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad}
    fit(m, tmp_path, max_steps=2)
    now = dict(m.named_parameters())
    assert all(torch.equal(now[n], v) for n, v in frozen.items())
    assert any(not torch.equal(now[n], v) for n, v in adapters.items())


def test_lora_on_a_t5_from_config_trains_only_its_adapters(data_dir, tmp_path, monkeypatch):
    """T5 (relative positions, its own decoder start): PEFT's default targets for it (the
    attention's q and v) train; the frozen base stays as built."""
    import tests.hf.helpers as helpers

    monkeypatch.setitem(helpers.CONFIGS, "seq2seq", T5)
    m = build("seq2seq", data_dir, peft=LORA)
    assert type(m.model.get_base_model()).__name__ == "T5ForConditionalGeneration"
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert {n.split(".lora_")[0].rsplit(".", 1)[1] for n in trainable} == {"q", "v"}
    assert grads_after_one_backward(m) == trainable
    frozen = {n: p.detach().clone() for n, p in m.named_parameters() if not p.requires_grad}
    fit(m, tmp_path, max_steps=2)
    now = dict(m.named_parameters())
    assert all(torch.equal(now[n], v) for n, v in frozen.items())
    assert any(now[n].abs().max() > 0 for n in trainable if "lora_B" in n)


@pytest.fixture
def llama(monkeypatch):
    """helpers' causal_lm model is a Llama from a config block, for one test."""
    import tests.hf.helpers as helpers

    monkeypatch.setitem(helpers.CONFIGS, "causal_lm", LLAMA)


def test_lora_learns_on_a_llama_from_config(data_dir, tmp_path, llama):
    """LoRA on a Llama's q_proj and v_proj: the loss on the rows it trained on falls."""
    m = build("causal_lm", data_dir, peft={**LORA, "r": 8, "target_modules": "all-linear"})
    m.lr = 2e-2  # adapters start at zero: LoRA wants a larger rate than a full fine-tune
    assert type(m.model.get_base_model()).__name__ == "LlamaForCausalLM"
    batch = m.data.collate([m.data.datasets["train"][i] for i in range(32)])

    def loss():
        m.eval()
        with torch.no_grad():
            return m.model(**batch).loss.item()

    before = loss()
    fit(m, tmp_path, max_steps=12, shuffle=False)
    assert loss() < before - 0.05, (before, loss())


def test_final_hf_is_an_adapter_peft_model_loads_with_the_trained_logits(data_dir, tmp_path):
    """A BERT from a save_pretrained directory, LoRA; PeftModel.from_pretrained(base,
    final/hf) gives the logits of the trained module."""
    from sailfin import Trainer, seed_everything
    from sailfin.hf import SequenceClassification
    from tests.hf.helpers import args

    base = base_dir("classification", data_dir, tmp_path)
    seed_everything(0)
    m = SequenceClassification(data("classification", data_dir), model_name_or_path=str(base),
                               lr=3e-3, peft=LORA)
    Trainer(m, args(tmp_path / "run", max_steps=3)).train()
    hf_dir = tmp_path / "run" / "final" / "hf"
    names = {p.name for p in hf_dir.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= names
    assert "model.safetensors" not in names  # the adapter only
    config = json.loads((hf_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    # The task's head once (it was ["classifier", "score", "classifier", "score"]).
    assert sorted(config["modules_to_save"]) == ["classifier", "score"], config
    loaded = peft.PeftModel.from_pretrained(
        transformers.AutoModelForSequenceClassification.from_pretrained(base), hf_dir).eval()
    m.eval()
    batch = batch_of(m)
    with torch.no_grad():
        assert torch.equal(m.model(**batch).logits, loaded(**batch).logits)
        untrained = transformers.AutoModelForSequenceClassification.from_pretrained(base)
        assert not torch.allclose(untrained.eval()(**batch).logits, loaded(**batch).logits)


def test_peft_merge_writes_a_plain_model_from_pretrained_loads(data_dir, tmp_path):
    m, _, _ = train("causal_lm", data_dir, tmp_path, max_steps=3,
                    module_kw={"peft": LORA, "peft_merge": True})
    hf_dir = tmp_path / "final" / "hf"
    assert (hf_dir / "model.safetensors").exists() and not (hf_dir / "adapter_config.json").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert not any("lora" in n for n, _ in loaded.named_parameters())
    m.eval()
    batch = batch_of(m)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, m.model(**batch).logits,
                                   rtol=1e-5, atol=1e-5)


def test_a_crash_and_resume_with_lora_ends_bit_identical(data_dir, tmp_path):
    run = dict(max_steps=5, checkpoint={"every_n_steps": 2}, val_every_n_steps=2)
    kw = {"peft": {**LORA, "lora_dropout": 0.1}}  # dropout: the random streams must resume
    ref, _, _ = train("classification", data_dir, tmp_path / "ref", module_kw=kw, **run)
    out = tmp_path / "run"
    with pytest.raises(Crash):
        train("classification", data_dir, out, callbacks=[CrashAt(3)], module_kw=kw, **run)
    module, trainer, _ = train("classification", data_dir, out, module_kw=kw, **run)
    assert trainer.resumed_from.name == "step-00000002"
    assert_same_params(params(ref), params(module))


def test_dp_lora_epsilon_is_opacus_rdp_accountant(data_dir, tmp_path):
    """sp-dp with LoRA: per-sample gradients only for the adapters and head (the frozen
    base stays), and the epsilon Opacus's accountant gives for the same history."""
    from opacus.accountants import RDPAccountant

    kw = {"peft": LORA, "config_kw": NO_DROPOUT["classification"]}
    torch.manual_seed(0)
    m, trainer, summary = train("classification", data_dir, tmp_path, max_steps=2,
                                backend="sp-dp", module_kw=kw,
                                dp={"noise_multiplier": 1.0, "delta": 1e-3})
    privacy = summary["privacy"]
    reference = RDPAccountant()
    reference.history = [(1.0, privacy["sample_rate"], 2)]
    assert privacy["accounted_steps"] == 2
    assert privacy["sample_rate"] == 8 / len(m.data.datasets["train"])
    assert abs(privacy["epsilon"] - reference.get_epsilon(delta=1e-3)) < 1e-9
    frozen = {n: p for n, p in m.named_parameters() if not p.requires_grad}
    assert frozen and all(getattr(p, "grad_sample", None) is None for p in frozen.values())


def test_an_unknown_peft_field_is_one_line_naming_it(data_dir, tmp_path):
    from sailfin.hf import SequenceClassification

    d = data("classification", data_dir)
    with pytest.raises(HFConfigError, match=r"unknown config key 'module.init_args.peft.rank'; "
                                            r"valid keys here: .*lora_alpha, .* r, .*LoraConfig"):
        SequenceClassification(d, config=dict(CONFIGS["classification"]), peft={"rank": 8})
    with pytest.raises(HFConfigError, match=r"'module.init_args.peft.lora_alfa' \(did you "
                                            r"mean 'lora_alpha'\?\)"):
        SequenceClassification(d, config=dict(CONFIGS["classification"]),
                               peft={"lora_alfa": 8})
    with pytest.raises(HFConfigError, match=r"peft.peft_type is 'LORRA'.*LORA"):
        SequenceClassification(d, config=dict(CONFIGS["classification"]),
                               peft={"peft_type": "lorra"})


def test_peft_by_yaml_and_an_unknown_init_arg_is_a_config_error(data_dir, tmp_path, capsys):
    text = yaml_config("classification", data_dir, tmp_path / "out")
    bad = text.replace("lr: 0.003", "lr: 0.003\n    pefft: {r: 4}")
    assert main(["train", write(tmp_path / "bad.yaml", bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown config key 'module.init_args.pefft'" in err[0]
    assert "did you mean 'peft'" in err[0]
    good = text.replace("lr: 0.003", "lr: 0.003\n    peft: {r: 4, lora_alpha: 8}")
    assert main(["train", write(tmp_path / "good.yaml", good)]) == 0
    assert (tmp_path / "out" / "final" / "hf" / "adapter_config.json").exists()


def test_memory_snapshots_on_and_off_give_bit_identical_adapters(data_dir, tmp_path, capfd):
    """LoRA (dropout on) killed at step 4 and resumed from its memory snapshots ends with
    the weights of the same run without snapshots."""
    from tests.checkpoint.test_memory import Settle

    kw = {"peft": {**LORA, "lora_dropout": 0.1}}
    ref, _, _ = train("causal_lm", data_dir, tmp_path / "ref", module_kw=kw, max_steps=5,
                      checkpoint={"at_epoch_end": False})
    snapshots = dict(max_steps=5, checkpoint={
        "at_epoch_end": False, "memory": {"every_n_steps": 1, "dir": str(tmp_path / "shm")}})
    out = tmp_path / "run"
    with pytest.raises(Crash):
        train("causal_lm", data_dir, out, callbacks=[Settle(), CrashAt(4)], module_kw=kw,
              **snapshots)
    capfd.readouterr()
    module, _, _ = train("causal_lm", data_dir, out, module_kw=kw, **snapshots)
    assert "resuming from memory, step 3" in capfd.readouterr().err
    assert_same_params(params(ref), params(module))


def test_lora_composes_with_activation_checkpointing_and_sp_amp(data_dir, tmp_path):
    """Recomputed blocks give the same adapters as stored activations; sp-amp trains them."""
    kw = {"peft": LORA, "config_kw": NO_DROPOUT["causal_lm"]}
    plain, _, _ = train("causal_lm", data_dir, tmp_path / "plain", max_steps=2, module_kw=kw)
    ckpt, _, _ = train("causal_lm", data_dir, tmp_path / "ckpt", max_steps=2,
                       module_kw={**kw, "activation_checkpointing": True})
    assert ckpt.model.get_base_model().is_gradient_checkpointing
    for key, value in params(plain).items():
        torch.testing.assert_close(params(ckpt)[key], value, rtol=1e-5, atol=1e-6)
    amp, _, summary = train("causal_lm", data_dir, tmp_path / "amp", max_steps=2,
                            module_kw=kw, backend="sp-amp")
    assert summary["global_step"] == 2
    lora_b = [p for n, p in amp.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().max() > 0 for p in lora_b)


def test_warmup_ratio_is_trainers_count_of_warm_up_steps(data_dir, tmp_path):
    """warmup_ratio 0.3 of 7 steps: ceil(2.1) = 3 warm-up steps, as transformers.Trainer."""
    from sailfin.hf import CausalLM

    m = CausalLM(data("causal_lm", data_dir), config=dict(CONFIGS["causal_lm"]), lr=1e-3,
                 warmup_ratio=0.3)
    from sailfin import Trainer
    from tests.hf.helpers import args

    Trainer(m, args(tmp_path, max_steps=7, epochs=7, max_train_steps_per_epoch=1)).train()
    assert m.warmup_in_effect == 3
    lrs = [json.loads(x)["lr"] for x in (tmp_path / "metrics.jsonl").open() if '"lr"' in x]
    assert lrs[:3] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3])
    with pytest.raises(HFConfigError, match="warmup_steps .2. and warmup_ratio .0.3. are "
                                            "both set; keep one"):
        CausalLM(m.data, config=dict(CONFIGS["causal_lm"]), warmup_steps=2, warmup_ratio=0.3)


def test_no_clipping_is_said_once_at_start(data_dir, tmp_path, capfd):
    train("classification", data_dir, tmp_path / "a", max_steps=1)
    err = capfd.readouterr().err
    assert err.count("trainer.max_grad_norm is null: gradients are not clipped "
                     "(transformers.Trainer clips at 1.0") == 1
    train("classification", data_dir, tmp_path / "b", max_steps=1, max_grad_norm=1.0)
    assert "not clipped" not in capfd.readouterr().err


def test_one_call_gives_a_recipe_of_ones_own_lora(data_dir, tmp_path):
    """apply_peft(recipe, model, fields): the model wrapped, the recipe's checkpoints
    marked to leave the frozen base out."""
    from sailfin import ModuleInterface
    from sailfin.hf.adapters import apply_peft

    class Mine(ModuleInterface):
        def __init__(self):
            super().__init__()
            cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)
            self.model = apply_peft(self, transformers.GPT2LMHeadModel(cfg),
                                    {"r": 2, "target_modules": ["c_attn"]}, "CAUSAL_LM")

    mine = Mine()
    assert mine.checkpoint_frozen_params is False and Mine.checkpoint_frozen_params
    names = {n for n, p in mine.named_parameters() if p.requires_grad}
    assert names and all("lora_" in n and "c_attn" in n for n in names)
    with pytest.raises(HFConfigError, match="module.init_args.peft: Target modules .*nope"):
        apply_peft(Mine.__new__(Mine), transformers.GPT2LMHeadModel(
            transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)),
            {"target_modules": ["nope"]})


def test_fsdp_units_of_a_lora_model_are_its_blocks(data_dir):
    """Under peft's wrapper the units are still the model's blocks, each holding frozen
    base weights and adapters together (FSDP2 shards both; only adapters get grads)."""
    from sailfin.backends.fsdp_units import select_units

    m = build("causal_lm", data_dir, peft=LORA)
    units = dict(select_units(m.model, None))
    assert sorted(units) == ["base_model.model.transformer.h.0",
                             "base_model.model.transformer.h.1"]
    for unit in units.values():
        flags = {p.requires_grad for p in unit.parameters()}
        assert flags == {True, False}


@pytest.mark.slow  # inductor compiles the model: minutes on 2 busy cores
def test_lora_under_compile_trains_the_adapters_as_eager(data_dir, tmp_path):
    kw = {"peft": LORA, "config_kw": NO_DROPOUT["causal_lm"]}
    eager, _, _ = train("causal_lm", data_dir, tmp_path / "eager", max_steps=2, module_kw=kw)
    compiled, _, _ = train("causal_lm", data_dir, tmp_path / "compiled", max_steps=2,
                           module_kw=kw, compile=True, compile_check=False)
    for key, value in params(eager).items():
        torch.testing.assert_close(params(compiled)[key], value, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("field,expected", [
    ("r: 1000000000", "config key 'module.init_args.peft.r' got 1000000000, more than the "
                      "rank any weight matrix of GPT2LMHeadModel can have (32, its largest is "),
    ("r: 2.5", "config key 'module.init_args.peft.r' got 2.5 (float); expected int"),
    ("r: eight", "config key 'module.init_args.peft.r' got 'eight' (str); expected int"),
    ("r: 0", "config key 'module.init_args.peft.r' got 0; a rank is 1 or more"),
    ("lora_alpha: .nan", "config key 'module.init_args.peft.lora_alpha' got nan (float); "
                         "expected int"),
    ("lora_dropout: .inf", "config key 'module.init_args.peft.lora_dropout' got inf; "
                           "expected a finite number"),
])
def test_a_rank_or_scale_peft_cannot_take_is_one_line_before_anything_is_allocated(
        data_dir, tmp_path, capsys, field, expected):
    text = yaml_config("causal_lm", data_dir, tmp_path / "out")
    bad = text.replace("lr: 0.003", f"lr: 0.003\n    peft: {{{field}}}")
    assert main(["train", write(tmp_path / "bad.yaml", bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_the_rank_bound_is_the_models_and_a_rank_pattern_is_held_to_it(data_dir):
    from sailfin.hf.adapters import apply_peft

    m = build("causal_lm", data_dir)
    with pytest.raises(HFConfigError, match=r"peft.rank_pattern.c_attn' got 33, more than .* "
                                            r"\(32, its largest"):
        apply_peft(torch.nn.Module(), m.model, {"r": 4, "rank_pattern": {"c_attn": 33}})
    wrapped = apply_peft(torch.nn.Module(), m.model, {"r": 32, "target_modules": ["c_attn"]})
    assert wrapped.peft_config["default"].r == 32  # the bound itself is taken
