"""The char_lm example: reads real text offline, trains, validates, generates."""

import json

from examples.char_lm.recipe import CharLM, StdlibText, read_stdlib
from sailfin.cli import main

TINY = ["--data.init_args.context", "32", "--data.init_args.max_bytes", "60000",
        "--module.init_args.context", "32", "--module.init_args.layers", "1",
        "--module.init_args.dim", "32", "--module.init_args.heads", "2",
        "--trainer.max_steps", "6", "--trainer.train_batch_size", "8",
        "--trainer.micro_batch_size", "4", "--trainer.log_every_n_steps", "3",
        "--trainer.writers", "[jsonl]"]


def test_corpus_is_python_source():
    text = read_stdlib(20_000)
    assert len(text) == 20_000 and b"def " in text and b"import " in text
    data = StdlibText(context=32, max_bytes=20_000, stride=16)
    x, y = data.train[3]
    assert x.shape == y.shape == (32,) and (x[1:] == y[:-1]).all()


def test_tiny_run_from_the_example_config(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "examples/char_lm/config.yaml", *TINY, "--trainer.backend",
                 "sp-amp", "--trainer.activation_checkpointing", "[Block]",
                 "--trainer.output_dir", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["global_step"] == 6 and summary["nonfinite_steps"] == 0
    assert 4.0 < summary["val"]["bits_per_byte"] < 8.5  # about log2(256) = 8 untrained
    assert "validation bits_per_byte" in capsys.readouterr().out


def test_generate_continues_a_prompt():
    model = CharLM(None, context=16, layers=1, dim=32, heads=2)
    out = model.generate(b"import ", 20, seed=1)
    assert isinstance(out, bytes) and len(out) == 20
    assert model.generate(b"import ", 20, seed=1) == out  # seeded
