"""TextData: text files tokenized for one task, in memory or as shards; padded per micro-batch."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Optional, Union

import torch

from ..data.shards import ShardDataset
from ..data.shards.index import write_atomic
from ..interfaces import DataInterface
from ..utils.progress_line import ProgressLine
from .errors import HFConfigError
from .files import check_columns, read_rows
from .tokenizers import TASKS, TokenizeText, from_shard_sample, load_tokenizer

ROWS_PER_JOB = 10_000  # rows tokenized between two looks at the progress line


class TextData(DataInterface):
    """Text files (JSON lines, CSV, parquet, or ``datasets`` objects) for a ``sailfin.hf`` module.

    The module names the task when it is built, and the files are tokenized then, by
    ``process_count`` processes, into memory or with ``shards_dir`` into sailfin shards
    (written once, then streamed). Batches are padded to their longest sample
    (:class:`PadCollate`). A text longer than ``max_length`` is truncated and counted
    (``truncated``), or refused with ``truncation: refuse``. Labels are the sorted
    distinct values of ``label_column``, or ``labels`` as given.

    Example::

        data = TextData("my-model", "train.jsonl", "val.jsonl", max_length=128)
        module = SequenceClassification(data, model_name_or_path="my-model")
    """

    def __init__(self, tokenizer: str, train_file: Union[str, Any],
                 val_file: Union[str, Any, None] = None, *, text_column: str = "text",
                 text_pair_column: Optional[str] = None, label_column: str = "label",
                 target_column: str = "summary", labels: Optional[list[str]] = None,
                 max_length: int = 128, target_max_length: int = 64,
                 truncation: str = "count", shards_dir: Optional[str] = None,
                 samples_per_shard: int = 1000, process_count: int = 1,
                 task: Optional[str] = None) -> None:
        if max_length < 2:
            raise HFConfigError(f"data.init_args.max_length is {max_length}; use 2 or more")
        self.tokenizer_path = tokenizer
        self.tokenizer = load_tokenizer(tokenizer)
        self.files = {"train": train_file, **({"val": val_file} if val_file is not None else {})}
        self.options = dict(text_column=text_column, text_pair_column=text_pair_column,
                            label_column=label_column, target_column=target_column,
                            max_length=max_length, target_max_length=target_max_length,
                            truncation=truncation)
        self.max_length, self.target_max_length = max_length, target_max_length
        self.given_labels = list(labels) if labels is not None else None
        self.shards_dir, self.samples_per_shard = shards_dir, samples_per_shard
        self.process_count = process_count
        self.task: Optional[str] = None
        self.labels: list[str] = []
        self.datasets: dict[str, torch.utils.data.Dataset] = {}
        self.truncated: dict[str, int] = {}
        self.mean_tokens = 0.0
        self.collate: Optional[PadCollate] = None
        if task is not None:
            self.prepare(task)

    # -- called by the module ---------------------------------------------------------
    def prepare(self, task: str) -> "TextData":
        """Read, check and tokenize every file for ``task`` (once; the module calls it)."""
        if self.task is not None:
            if task != self.task:
                raise HFConfigError(f"data.init_args.task is '{self.task}', but the module "
                                    f"trains '{task}'; remove data.init_args.task")
            return self
        if task not in TASKS:
            raise HFConfigError(f"task '{task}': use one of {', '.join(TASKS)}")
        self.task = task
        columns = self._columns(task)
        rows = {}
        for split, source in self.files.items():
            rows[split] = read_rows(source, f"{split}_file")
            check_columns(rows[split], columns, _label(source), f"{split}_file", task)
        if task in ("classification", "token_classification"):
            self.labels = self._find_labels(rows, task)
        label2id = {name: i for i, name in enumerate(self.labels)}
        processor = TokenizeText(self.tokenizer_path, task, label2id=label2id,
                                 samples_per_shard=self.samples_per_shard, **self.options)
        processor._tokenizer = self.tokenizer
        for split, source in self.files.items():
            self.datasets[split], self.truncated[split], lengths = self._tokenize(
                processor, split, source, len(rows[split]))
            if split == "train":
                self.mean_tokens = sum(lengths) / max(1, len(lengths))
        pad = self.tokenizer.pad_token_id
        self.collate = PadCollate(pad, label_pad=-100 if task != "classification" else None,
                                  causal=task == "causal_lm")
        return self

    def _columns(self, task: str) -> dict[str, str]:
        o = self.options
        cols = {"text_column": o["text_column"]}
        if o["text_pair_column"]:
            cols["text_pair_column"] = o["text_pair_column"]
        if task in ("classification", "token_classification"):
            cols["label_column"] = o["label_column"]
        if task == "seq2seq":
            cols["target_column"] = o["target_column"]
        return cols

    def _find_labels(self, rows: dict[str, list], task: str) -> list[str]:
        column = self.options["label_column"]
        seen: set[str] = set()
        for split_rows in rows.values():
            for row in split_rows:
                values = row[column] if task == "token_classification" else [row[column]]
                seen.update(str(v) for v in values)
        if self.given_labels is None:
            return sorted(seen, key=_natural)
        missing = sorted(seen - set(map(str, self.given_labels)))
        if missing:
            raise HFConfigError(f"data.init_args.labels lacks {', '.join(missing[:5])}, found "
                                f"in '{column}'; add them or leave labels unset")
        return [str(x) for x in self.given_labels]

    def _tokenize(self, processor: TokenizeText, split: str, source: Any, n_rows: int
                  ) -> tuple[torch.utils.data.Dataset, int, list[int]]:
        workers = max(1, min(self.process_count, n_rows))
        # Row ranges of a few per worker (uneven ones balance), at most ROWS_PER_JOB each:
        # a progress line as each range is done (each process reads the file once).
        per_job = max(1, min(math.ceil(n_rows / workers / 4), ROWS_PER_JOB))
        # Every rank of a job tokenizes; rank 0 says how far it is.
        rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
        line = ProgressLine(f"tokenizing {split} ({_label(source)})", "rows", total=n_rows,
                            enabled=rank == "0")

        def tokenized(part: dict[str, Any]) -> None:
            line.add(len(part["lengths"]))

        if self.shards_dir is None or not isinstance(source, str):
            jobs = [(source, a, min(a + per_job, n_rows)) for a in range(0, n_rows, per_job)]
            done = processor.multi_process_data(jobs, process_count=workers,
                                                on_result=tokenized)
            line.close()
            samples = [s for part in done for s in part["samples"]]
            return (ListDataset(samples), sum(p["truncated"] for p in done),
                    [n for p in done for n in p["lengths"]])
        out = os.path.join(self.shards_dir, split)
        meta_path = os.path.join(out, "meta.json")
        stat = os.stat(source)
        meta = {"source": os.path.abspath(source), "size": stat.st_size, "mtime": stat.st_mtime,
                "task": self.task, "labels": self.labels,
                "tokenizer": os.path.abspath(self.tokenizer_path), **self.options}
        if not _same_meta(meta_path, meta):
            # Whole shards per job: a job starts at a multiple of samples_per_shard.
            step = max(1, math.ceil(per_job / self.samples_per_shard)) * self.samples_per_shard
            jobs = [(source, a, min(a + step, n_rows), out, a // self.samples_per_shard)
                    for a in range(0, n_rows, step)]
            done = processor.multi_process_data(jobs, process_count=workers,
                                                on_result=tokenized)
            line.close(f"{sum(len(p['shards']) for p in done)} shard(s) in {out}")
            meta["truncated"] = sum(p["truncated"] for p in done)
            meta["lengths"] = [n for p in done for n in p["lengths"]]
            meta["shards"] = [os.path.basename(s) for p in done for s in p["shards"]]
            # Written last: the shards are complete.
            write_atomic(meta_path, json.dumps(meta).encode())
        with open(meta_path) as fh:
            meta = json.load(fh)
        urls = [os.path.join(out, s) for s in meta["shards"]]
        ds = ShardDataset(urls, decode="numpy", transform=from_shard_sample, shuffle=False)
        return ds, meta["truncated"], meta["lengths"]

    # -- DataInterface ------------------------------------------------------------------
    def get_train_dataset(self) -> torch.utils.data.Dataset:
        self._need_prepare()
        return self.datasets["train"]

    def get_val_dataset(self) -> Optional[torch.utils.data.Dataset]:
        self._need_prepare()
        return self.datasets.get("val")

    def _need_prepare(self) -> None:
        if self.task is None:
            raise HFConfigError("TextData has not been prepared: give it to a sailfin.hf "
                                "module, or set data.init_args.task")


class ListDataset(torch.utils.data.Dataset):
    """Tokenized samples held in memory."""

    def __init__(self, samples: list[dict[str, Any]]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.samples[i]


class PadCollate:
    """Pads a list of ``{"input_ids": [...], "labels": ...}`` to its longest sample:
    ``input_ids`` with ``pad_id``, plus an ``attention_mask``; list labels with
    ``label_pad`` (-100: the loss skips it); int labels become a 1-D tensor.
    ``causal``: the labels are the inputs, -100 at padding.

    Example::

        batch = PadCollate(pad_id=0)([{"input_ids": [5, 6, 7], "labels": [1, 2, 1]},
                                      {"input_ids": [5], "labels": [0]}])
        batch["input_ids"].shape      # torch.Size([2, 3])
    """

    def __init__(self, pad_id: int, label_pad: Optional[int] = -100, causal: bool = False
                 ) -> None:
        self.pad_id, self.label_pad, self.causal = pad_id, label_pad, causal

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [s["input_ids"] for s in samples]
        input_ids = _pad(ids, self.pad_id)
        mask = _pad([[1] * len(x) for x in ids], 0)
        batch = {"input_ids": input_ids, "attention_mask": mask}
        if self.causal:
            batch["labels"] = input_ids.masked_fill(mask == 0, -100)
        elif "labels" in samples[0]:
            labels = [s["labels"] for s in samples]
            if isinstance(labels[0], list):
                batch["labels"] = _pad(labels, -100 if self.label_pad is None else self.label_pad)
            else:
                batch["labels"] = torch.tensor(labels, dtype=torch.long)
        return batch


def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence([torch.as_tensor(r, dtype=torch.long) for r in rows],
                                           batch_first=True, padding_value=value)


def _same_meta(path: str, meta: dict[str, Any]) -> bool:
    try:
        with open(path) as fh:
            old = json.load(fh)
    except (OSError, ValueError):
        return False
    return all(old.get(k) == v for k, v in meta.items())


def _natural(label: str) -> tuple:
    return (0, int(label), "") if label.lstrip("-").isdigit() else (1, 0, label)


def _label(source: Any) -> str:
    return source if isinstance(source, str) else type(source).__name__
