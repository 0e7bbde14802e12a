"""TokenizeText: rows of text -> token ids (and labels), in memory or as sailfin shards."""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import numpy as np

from ..data.shards import ShardWriter
from ..interfaces import DataProcessor
from .errors import HFConfigError
from .files import read_rows
from .tokenizers import load_tokenizer

TASKS = ("classification", "token_classification", "causal_lm", "seq2seq")
TRUNCATION = ("count", "refuse")
IGNORE = -100  # label of a position the loss and the metrics skip (HF's convention)


class TokenizeText(DataProcessor):
    """Tokenizes rows ``[start, stop)`` of a text file for one task.

    ``process(source, start, stop, out_dir=None, shard_index=0)`` returns a dict:
    ``samples`` (a list of ``{"input_ids": [...], "labels": ...}``) or, with
    ``out_dir``, ``shards`` (the shard files written there, numbered from
    ``shard_index``, ``samples_per_shard`` each), plus ``truncated`` (how many rows
    were longer than ``max_length``) and ``lengths`` (tokens per sample).
    ``multi_process_data`` runs it over row ranges in parallel; each worker loads
    the tokenizer once.

    Example::

        tok = TokenizeText("my-model", "classification", label2id={"neg": 0, "pos": 1})
        out = tok.multi_process_data([("train.jsonl", 0, 500), ("train.jsonl", 500, 1000)],
                                     process_count=2)
    """

    def __init__(self, tokenizer: str, task: str, *, text_column: str = "text",
                 text_pair_column: Optional[str] = None, label_column: Optional[str] = "label",
                 target_column: str = "summary", max_length: int = 128,
                 target_max_length: int = 64, truncation: str = "count",
                 label2id: Optional[dict[str, int]] = None, samples_per_shard: int = 1000,
                 node_rank: int = 0, num_nodes: int = 1) -> None:
        super().__init__(node_rank, num_nodes)
        if task not in TASKS:
            raise HFConfigError(f"task is '{task}'; use one of {', '.join(TASKS)}")
        if truncation not in TRUNCATION:
            raise HFConfigError(f"data.init_args.truncation is '{truncation}'; use 'count' "
                                "(truncate and count the rows) or 'refuse' (stop)")
        self.tokenizer_path = tokenizer
        self.task = task
        self.text_column, self.text_pair_column = text_column, text_pair_column
        self.label_column, self.target_column = label_column, target_column
        self.max_length, self.target_max_length = max_length, target_max_length
        self.truncation = truncation
        self.label2id = dict(label2id or {})
        self.samples_per_shard = samples_per_shard
        self._tokenizer: Any = None
        self._rows: Optional[tuple[str, list]] = None  # the file last read, and its rows

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_tokenizer"] = None  # each worker loads its own
        state["_rows"] = None       # ... and reads the file once, for all its row ranges
        return state

    def _read(self, source: Union[str, Any]) -> list:
        if not isinstance(source, str):
            return read_rows(source)
        if self._rows is None or self._rows[0] != source:
            self._rows = (source, read_rows(source))
        return self._rows[1]

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_path)
        return self._tokenizer

    # -- DataProcessor ---------------------------------------------------------------
    def process(self, source: Union[str, Any], start: int, stop: int,
                out_dir: Optional[str] = None, shard_index: int = 0) -> dict[str, Any]:
        rows = self._read(source)[start:stop]
        if self.task == "token_classification":
            samples, truncated = [], 0
            for i, row in enumerate(rows, start):
                sample, cut = self.encode(row, f"{_name(source)} row {i + 1}")
                samples.append(sample)
                truncated += cut
        else:  # one call for all rows: the tokenizer's per-call cost is paid once
            samples, truncated = self.encode_rows(rows, source, start)
        lengths = [len(s["input_ids"]) for s in samples]
        if out_dir is None:
            return {"samples": samples, "truncated": truncated, "lengths": lengths}
        with ShardWriter(out_dir, self.samples_per_shard, start_index=shard_index) as writer:
            for i, sample in enumerate(samples, start):
                writer.write(to_shard_sample(i, sample))
        return {"shards": writer.shards, "truncated": truncated, "lengths": lengths}

    # -- many rows ----------------------------------------------------------------------
    def encode_rows(self, rows: list[dict[str, Any]], source: Any = "rows", start: int = 0
                    ) -> tuple[list[dict[str, Any]], int]:
        """What :meth:`encode` gives for each row (not token classification), from one
        tokenizer call over all rows (and one more over those longer than max_length)."""
        tok = self.tokenizer
        texts = [row[self.text_column] for row in rows]
        pairs = [row[self.text_pair_column] for row in rows] if self.text_pair_column else None
        if not texts:
            return [], 0
        ids = [list(x) for x in tok(texts, pairs, truncation=False)["input_ids"]]
        long = [i for i, x in enumerate(ids) if len(x) > self.max_length]
        if long and self.truncation == "refuse":
            self._encode(f"{_name(source)} row {start + long[0] + 1}", texts[long[0]],
                         pairs[long[0]] if pairs else None)  # raises, naming the row
        if long:
            cut = tok([texts[i] for i in long], [pairs[i] for i in long] if pairs else None,
                      truncation=True, max_length=self.max_length)["input_ids"]
            for i, x in zip(long, cut):
                ids[i] = list(x)
        if self.task == "classification":
            samples = [{"input_ids": x, "labels": self._label_id(
                row[self.label_column], f"{_name(source)} row {start + i + 1}")}
                for i, (x, row) in enumerate(zip(ids, rows))]
        elif self.task == "causal_lm":
            eos = tok.eos_token_id
            for x in ids:
                if eos is not None and (not x or x[-1] != eos) and len(x) < self.max_length:
                    x.append(eos)  # the model learns where a text ends
            samples = [{"input_ids": x} for x in ids]
        else:  # seq2seq
            targets = tok(text_target=[str(row[self.target_column]) for row in rows],
                          truncation=True, max_length=self.target_max_length)["input_ids"]
            samples = [{"input_ids": x, "labels": list(t)} for x, t in zip(ids, targets)]
        return samples, len(long)

    # -- one row -----------------------------------------------------------------------
    def encode(self, row: dict[str, Any], where: str) -> tuple[dict[str, Any], int]:
        """``({"input_ids": [...], "labels": ...}, 1 if truncated else 0)``."""
        tok = self.tokenizer
        if self.task == "token_classification":
            words = list(row[self.text_column])
            tags = list(row[self.label_column])
            if len(words) != len(tags):
                raise HFConfigError(f"{where}: {len(words)} words but {len(tags)} tags in "
                                    f"'{self.text_column}'/'{self.label_column}'; give one "
                                    "tag per word")
            enc, cut = self._encode(where, words, is_split_into_words=True)
            labels, previous = [], None
            for word in enc.word_ids():
                # The first sub-word of a word carries its tag; the rest are skipped.
                labels.append(IGNORE if word is None or word == previous
                              else self._label_id(tags[word], where))
                previous = word
            return {"input_ids": enc["input_ids"], "labels": labels}, cut
        pair = row[self.text_pair_column] if self.text_pair_column else None
        enc, cut = self._encode(where, row[self.text_column], pair)
        ids = list(enc["input_ids"])
        if self.task == "classification":
            return {"input_ids": ids, "labels": self._label_id(row[self.label_column], where)}, cut
        if self.task == "causal_lm":
            eos = tok.eos_token_id
            if eos is not None and (not ids or ids[-1] != eos) and len(ids) < self.max_length:
                ids.append(eos)  # the model learns where a text ends
            return {"input_ids": ids}, cut
        target = tok(text_target=str(row[self.target_column]), truncation=True,
                     max_length=self.target_max_length)["input_ids"]
        return {"input_ids": ids, "labels": list(target)}, cut

    def _encode(self, where: str, text: Any, pair: Any = None, **kw: Any) -> tuple[Any, int]:
        enc = self.tokenizer(text, pair, truncation=False, **kw)
        n = len(enc["input_ids"])
        if n <= self.max_length:
            return enc, 0
        if self.truncation == "refuse":
            raise HFConfigError(f"{where}: {n} tokens, more than data.init_args.max_length "
                                f"{self.max_length}; raise max_length or set truncation: count "
                                "(truncate and count)")
        return self.tokenizer(text, pair, truncation=True, max_length=self.max_length, **kw), 1

    def _label_id(self, label: Any, where: str) -> int:
        try:
            return self.label2id[str(label)]
        except KeyError:
            raise HFConfigError(f"{where}: label '{label}' is not among the labels "
                                f"({', '.join(self.label2id)}); add it to data.init_args.labels"
                                ) from None


def to_shard_sample(index: int, sample: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"__key__": f"{index:09d}",
                           "input_ids.npy": np.asarray(sample["input_ids"], dtype=np.int32)}
    labels = sample.get("labels")
    if isinstance(labels, list):
        out["labels.npy"] = np.asarray(labels, dtype=np.int32)
    elif labels is not None:
        out["labels.cls"] = int(labels)
    return out


def from_shard_sample(raw: dict[str, Any]) -> dict[str, Any]:
    """A decoded shard sample (``decode="numpy"``) back to the in-memory form."""
    out: dict[str, Any] = {"input_ids": raw["input_ids.npy"].tolist()}
    if "labels.npy" in raw:
        out["labels"] = raw["labels.npy"].tolist()
    elif "labels.cls" in raw:
        out["labels"] = int(raw["labels.cls"])
    return out


def _name(source: Any) -> str:
    return os.path.basename(source) if isinstance(source, str) else type(source).__name__
