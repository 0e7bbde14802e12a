"""TextData: padding per micro-batch, truncation, shards, parallel tokenizing, bad input."""

import json

import pytest

from sailfin.cli import main
from sailfin.hf import HFConfigError, SequenceClassification, TextData
from tests.hf.helpers import CONFIGS, VOCAB, yaml_config, write

pytest.importorskip("transformers")


def tok(data_dir):
    return str(data_dir / f"tokenizer-{VOCAB}")


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [{"text": "def f(x): return x" + " + x" * i, "label": "ab"[i % 2]} for i in range(12)]


def test_batches_are_padded_to_their_longest_sample(data_dir, tmp_path):
    data = TextData(tok(data_dir), jsonl(tmp_path / "t.jsonl", ROWS), task="classification")
    samples = [data.datasets["train"][i] for i in (0, 1, 5)]
    batch = data.collate(samples)
    longest = max(len(s["input_ids"]) for s in samples)
    assert batch["input_ids"].shape == (3, longest) < (3, data.max_length)
    assert batch["attention_mask"].sum(1).tolist() == [len(s["input_ids"]) for s in samples]
    assert batch["labels"].tolist() == [0, 1, 1] and data.labels == ["a", "b"]
    pad = data.tokenizer.pad_token_id
    assert (batch["input_ids"][batch["attention_mask"] == 0] == pad).all()


def test_truncation_is_counted_or_refused(data_dir, tmp_path):
    train = jsonl(tmp_path / "t.jsonl", ROWS)
    lengths = [len(TextData(tok(data_dir), train, task="classification", max_length=512)
                   .datasets["train"][i]["input_ids"]) for i in range(12)]
    limit = sorted(lengths)[6]
    data = TextData(tok(data_dir), train, task="classification", max_length=limit)
    assert data.truncated["train"] == sum(n > limit for n in lengths) > 0
    assert max(len(s["input_ids"]) for s in data.datasets["train"].samples) == limit
    with pytest.raises(HFConfigError, match=r"t.jsonl row \d+: \d+ tokens, more than "
                                            rf"data.init_args.max_length {limit}") as err:
        TextData(tok(data_dir), train, task="classification", max_length=limit,
                 truncation="refuse")
    assert "\n" not in str(err.value)


def test_shards_and_two_processes_give_the_same_samples(data_dir, tmp_path):
    train = jsonl(tmp_path / "t.jsonl", ROWS)
    memory = TextData(tok(data_dir), train, task="classification")
    sharded = TextData(tok(data_dir), train, task="classification", process_count=2,
                       shards_dir=str(tmp_path / "shards"), samples_per_shard=4)
    assert sorted(p.name for p in (tmp_path / "shards" / "train").glob("*.tar")) == [
        "shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    expected = [memory.datasets["train"][i] for i in range(12)]
    assert [sharded.datasets["train"][i] for i in range(12)] == expected
    parallel = TextData(tok(data_dir), train, task="classification", process_count=2)
    assert parallel.datasets["train"].samples == expected
    # Written once: a second TextData reads the shards (nothing rewritten).
    stamp = (tmp_path / "shards" / "train" / "shard-000000.tar").stat().st_mtime_ns
    again = TextData(tok(data_dir), train, task="classification",
                     shards_dir=str(tmp_path / "shards"), samples_per_shard=4)
    assert again.datasets["train"][3] == expected[3]
    assert (tmp_path / "shards" / "train" / "shard-000000.tar").stat().st_mtime_ns == stamp


@pytest.mark.parametrize("shards", [False, True])
def test_tokenizing_says_how_many_rows_and_how_fast(data_dir, tmp_path, capsys, monkeypatch,
                                                    shards):
    """A minute of silence while a large file was tokenized: a line per range of rows."""
    from sailfin.utils import progress_line

    monkeypatch.setattr(progress_line, "REPORT_SECONDS", 0.0)  # a line per range done
    extra = {"shards_dir": str(tmp_path / "shards"), "samples_per_shard": 5} if shards else {}
    TextData(tok(data_dir), jsonl(tmp_path / "t.jsonl", ROWS), task="classification", **extra)
    said = [line for line in capsys.readouterr().err.splitlines()
            if line.startswith(f"sailfin: tokenizing train ({tmp_path / 't.jsonl'}): ")]
    counts = [line.split(": ", 2)[2].split(" rows")[0] for line in said]
    # Ranges of rows (3 here; whole shards of 5 with shards), then the closing line.
    step = 5 if shards else 3
    assert counts == [f"{min(n, 12)} of 12" for n in range(step, 12 + step, step)] + ["12"]
    assert said[0].endswith(" rows/s") and f" ({100 * step / 12:.0f}%), " in said[0]
    assert said[-1].endswith(" s") and (", 3 shard(s) in " in said[-1]) == shards
    monkeypatch.setenv("RANK", "1")  # another rank of a job: it tokenizes, rank 0 says so
    TextData(tok(data_dir), jsonl(tmp_path / "u.jsonl", ROWS), task="classification")
    assert "tokenizing" not in capsys.readouterr().err


def test_token_labels_sit_on_each_words_first_sub_word(data_dir, tmp_path):
    rows = [{"words": ["def", "read_file_lines", "(", "path", ")"],
             "tags": ["B-KW", "B-REF", "O", "B-REF", "O"]}]
    data = TextData(tok(data_dir), jsonl(tmp_path / "t.jsonl", rows), task="token_classification",
                    text_column="words", label_column="tags")
    sample = data.datasets["train"][0]
    ids = data.labels
    kept = [ids[t] for t in sample["labels"] if t != -100]
    assert kept == rows[0]["tags"]
    assert len(sample["labels"]) == len(sample["input_ids"]) > 5  # sub-words were skipped


# -- bad input: one line each, before the first step ------------------------------------
def test_a_model_directory_without_a_tokenizer(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(HFConfigError, match=r"data.init_args.tokenizer: '.*model' has no "
                                            "tokenizer"):
        TextData(str(tmp_path / "model"), jsonl(tmp_path / "t.jsonl", ROWS))


def test_a_missing_label_column(data_dir, tmp_path):
    with pytest.raises(HFConfigError, match="data.init_args.label_column is 'category', but "
                                            ".* has no such column .*columns: label, text"):
        TextData(tok(data_dir), jsonl(tmp_path / "t.jsonl", ROWS), label_column="category",
                 task="classification")


def test_num_labels_disagreeing_with_the_data(data_dir, tmp_path):
    data = TextData(tok(data_dir), jsonl(tmp_path / "t.jsonl", ROWS))
    with pytest.raises(HFConfigError, match=r"num_labels is 3, but the data has 2 labels "
                                            r"\(a, b\); set num_labels 2"):
        SequenceClassification(data, config=dict(CONFIGS["classification"]), num_labels=3)


def test_the_cli_prints_one_line_and_exits_2(data_dir, tmp_path, capsys):
    text = yaml_config("classification", data_dir, tmp_path / "out")
    text = text.replace("lr: 0.003", "lr: 0.003\n    num_labels: 2")
    assert main(["train", write(tmp_path / "c.yaml", text)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "num_labels is 2, but the data has 6 labels" in err[0]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_text_longer_than_the_model_allows(data_dir, tmp_path):
    data = TextData(tok(data_dir), jsonl(tmp_path / "t.jsonl", ROWS), max_length=128)
    with pytest.raises(HFConfigError, match="max_length is 128, more than the 64 tokens "
                                            r"BertForSequenceClassification takes \(its "
                                            r"max_position_embeddings 64\); lower max_length "
                                            "to 64"):
        SequenceClassification(data, config=dict(CONFIGS["classification"]))


ROBERTA = {"model_type": "roberta", "hidden_size": 32, "num_hidden_layers": 1,
           "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64}


def test_roberta_positions_start_after_padding_idx_and_stop_before_step_1(data_dir, tmp_path):
    """max_length 64 on a RoBERTa of 64 positions: its positions start at padding_idx + 1,
    so fewer tokens fit. Refused with the setting named (not an index error mid-run), and
    the length it names trains through a row that long."""
    long_rows = ROWS + [{"text": " ".join(["x"] * 200), "label": "a"}]
    data = TextData(tok(data_dir), jsonl(tmp_path / "t.jsonl", long_rows), max_length=64)
    pad = data.tokenizer.pad_token_id  # the model's padding_idx (from the tokenizer)
    fit = 64 - pad - 1
    with pytest.raises(HFConfigError, match=rf"max_length is 64, more than the {fit} tokens "
                                            r"RobertaForSequenceClassification takes \(its "
                                            rf"max_position_embeddings 64 less its position "
                                            rf"offset {pad + 1} .*padding_idx {pad}\)\); lower "
                                            rf"max_length to {fit}"):
        SequenceClassification(data, config=dict(ROBERTA))
    from sailfin import Trainer
    from tests.hf.helpers import args

    data = TextData(tok(data_dir), jsonl(tmp_path / "t.jsonl", long_rows), max_length=fit)
    m = SequenceClassification(data, config=dict(ROBERTA))
    assert max(len(s["input_ids"]) for s in data.datasets["train"]) == fit
    summary = Trainer(m, args(tmp_path / "out", max_steps=1, train_batch_size=13,
                              micro_batch_size=13, shuffle=False)).train()
    assert summary["global_step"] == 1 and data.truncated["train"] == 1


def test_parquet_and_a_save_to_disk_directory_train_like_json_lines(data_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.checkpoint.helpers import assert_same_params, params

    datasets = pytest.importorskip("datasets")
    rows = [json.loads(x) for x in (data_dir / "classification-train.jsonl").open()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"), max_shard_size=2000)
    assert len(list((tmp_path / "saved").glob("*.arrow"))) > 1  # several files, in order
    from sailfin import Trainer, seed_everything
    from tests.hf.helpers import args

    def run(source, out):
        seed_everything(0)
        d = TextData(tok(data_dir), str(source), str(data_dir / "classification-val.jsonl"),
                     max_length=64)
        m = SequenceClassification(d, config=dict(CONFIGS["classification"]), lr=3e-3)
        Trainer(m, args(out, max_steps=3)).train()
        return m

    ref = run(data_dir / "classification-train.jsonl", tmp_path / "jsonl")
    for name, source in (("parquet", tmp_path / "train.parquet"),
                         ("saved", tmp_path / "saved")):
        m = run(source, tmp_path / name)
        assert list(m.data.datasets["train"]) == list(ref.data.datasets["train"])
        assert_same_params(params(ref), params(m))


def test_a_save_to_disk_directory_of_splits_names_them(data_dir, tmp_path):
    datasets = pytest.importorskip("datasets")
    d = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict({"train": d, "test": d}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(HFConfigError, match=r"holds several splits \(train, test\); give "
                                            r"one of them, e\.g\. .*dd/train"):
        TextData(tok(data_dir), str(tmp_path / "dd"), task="classification")
    data = TextData(tok(data_dir), str(tmp_path / "dd" / "train"), task="classification")
    assert len(data.datasets["train"]) == len(ROWS)
