"""Tokenizers (loaded with one-line errors, or trained small on local text), and
TokenizeText: rows of text -> token ids (and labels), in memory or as sailfin shards."""

from __future__ import annotations

import os
import shutil
from typing import Any, Callable, Iterable, Optional, Union

import numpy as np

from ..data.shards import ShardWriter
from ..interfaces import DataProcessor
from .errors import HFConfigError, require
from .files import read_rows

TASKS = ("classification", "token_classification", "causal_lm", "seq2seq")
TRUNCATION = ("count", "refuse")
IGNORE = -100  # label of a position the loss and the metrics skip (HF's convention)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json",
                   "spiece.model", "sentencepiece.bpe.model", "tokenizer.model")
SPECIAL = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]",
           "sep_token": "[SEP]", "mask_token": "[MASK]", "bos_token": "[CLS]",
           "eos_token": "[SEP]"}


def load_tokenizer(path: str, key: str = "data.init_args.tokenizer") -> Any:
    """``AutoTokenizer.from_pretrained(path)`` (a fast tokenizer); a local directory
    without tokenizer files is one line naming it."""
    transformers = require("transformers")
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f))
                                       for f in TOKENIZER_FILES):
        raise HFConfigError(f"{key}: '{path}' has no tokenizer (none of "
                            f"{', '.join(TOKENIZER_FILES[:3])}...); save one there with "
                            "tokenizer.save_pretrained(dir) or point tokenizer at one")
    if not os.path.isdir(path) and (os.path.isabs(path) or path.startswith(".")):
        raise HFConfigError(f"{key}: no directory '{path}'")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:  # GPT-2 style: pad with the end-of-text token
        tok.pad_token = tok.eos_token
    return tok


def train_tokenizer(texts: Iterable[str], out_dir: str, vocab_size: int = 2000) -> Any:
    """A byte-level BPE tokenizer trained on ``texts`` (the ``tokenizers`` library),
    saved to ``out_dir`` with ``save_pretrained``: [CLS] text [SEP], [PAD] padding.

    Example::

        tok = train_tokenizer(["def f(x):", "return x"], "outputs/tok", vocab_size=300)
    """
    tk = require("tokenizers")
    transformers = require("transformers")
    model = tk.Tokenizer(tk.models.BPE(unk_token="[UNK]"))
    model.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tk.decoders.ByteLevel()
    specials = list(dict.fromkeys(SPECIAL.values()))
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                     show_progress=False)
    model.train_from_iterator(texts, trainer)
    cls, sep = model.token_to_id("[CLS]"), model.token_to_id("[SEP]")
    model.post_processor = tk.processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=model, **SPECIAL)
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    fast.save_pretrained(tmp)
    if not os.path.exists(out_dir):
        os.replace(tmp, out_dir)  # whole or not at all
    else:  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return transformers.AutoTokenizer.from_pretrained(out_dir)


class TokenizeText(DataProcessor):
    """Tokenizes rows ``[start, stop)`` of a text file for one task:
    ``process(source, start, stop, out_dir=None, shard_index=0)`` returns ``samples``
    (``{"input_ids": [...], "labels": ...}`` each) or, with ``out_dir``, ``shards``
    (written there from ``shard_index``), plus ``truncated`` (rows longer than
    ``max_length``) and ``lengths`` (tokens per sample). Each worker of
    ``multi_process_data`` loads the tokenizer once.

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
        samples, truncated = self.encode_rows(rows, source, start)
        lengths = [len(s["input_ids"]) for s in samples]
        if out_dir is None:
            return {"samples": samples, "truncated": truncated, "lengths": lengths}
        with ShardWriter(out_dir, self.samples_per_shard, start_index=shard_index) as writer:
            for i, sample in enumerate(samples, start):
                writer.write(to_shard_sample(i, sample))
        return {"shards": writer.shards, "truncated": truncated, "lengths": lengths}

    # -- rows -> samples ----------------------------------------------------------------
    def encode_rows(self, rows: list[dict[str, Any]], source: Any = "rows", start: int = 0
                    ) -> tuple[list[dict[str, Any]], int]:
        """What :meth:`encode` gives for each row, and how many were truncated; except for
        token classification, from one tokenizer call over all rows (and one more over
        those longer than max_length): the tokenizer's per-call cost is paid once."""
        def where(i: int) -> str:
            return f"{_name(source)} row {start + i + 1}"

        if self.task == "token_classification":
            out = [self.encode(row, where(i)) for i, row in enumerate(rows)]
            return [sample for sample, _ in out], sum(cut for _, cut in out)
        return self._encode_many(rows, where)

    def encode(self, row: dict[str, Any], where: str) -> tuple[dict[str, Any], int]:
        """``({"input_ids": [...], "labels": ...}, 1 if truncated else 0)``."""
        if self.task != "token_classification":
            samples, cut = self._encode_many([row], lambda i: where)
            return samples[0], cut
        words = list(row[self.text_column])
        tags = list(row[self.label_column])
        if len(words) != len(tags):
            raise HFConfigError(f"{where}: {len(words)} words but {len(tags)} tags in "
                                f"'{self.text_column}'/'{self.label_column}'; give one "
                                "tag per word")
        enc = self.tokenizer(words, truncation=False, is_split_into_words=True)
        cut = int(len(enc["input_ids"]) > self.max_length)
        if cut:
            self._check_length(where, len(enc["input_ids"]))
            enc = self.tokenizer(words, truncation=True, max_length=self.max_length,
                                 is_split_into_words=True)
        labels, previous = [], None
        for word in enc.word_ids():
            # The first sub-word of a word carries its tag; the rest are skipped.
            labels.append(IGNORE if word is None or word == previous
                          else self._label_id(tags[word], where))
            previous = word
        return {"input_ids": enc["input_ids"], "labels": labels}, cut

    def _encode_many(self, rows: list[dict[str, Any]], where: Callable[[int], str]
                     ) -> tuple[list[dict[str, Any]], int]:
        tok = self.tokenizer
        texts = [row[self.text_column] for row in rows]
        pairs = [row[self.text_pair_column] for row in rows] if self.text_pair_column else None
        if not texts:
            return [], 0
        ids = [list(x) for x in tok(texts, pairs, truncation=False)["input_ids"]]
        long = [i for i, x in enumerate(ids) if len(x) > self.max_length]
        if long:
            self._check_length(where(long[0]), len(ids[long[0]]))
            cut = tok([texts[i] for i in long], [pairs[i] for i in long] if pairs else None,
                      truncation=True, max_length=self.max_length)["input_ids"]
            for i, x in zip(long, cut):
                ids[i] = list(x)
        if self.task == "classification":
            samples = [{"input_ids": x, "labels": self._label_id(row[self.label_column], where(i))}
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

    def _check_length(self, where: str, n: int) -> None:
        """A text of ``n`` tokens, more than max_length: refused, or truncated and counted."""
        if self.truncation == "refuse":
            raise HFConfigError(f"{where}: {n} tokens, more than data.init_args.max_length "
                                f"{self.max_length}; raise max_length or set truncation: count "
                                "(truncate and count)")

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
