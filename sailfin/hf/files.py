"""Reading rows of text: JSON lines, CSV with a header, parquet, a ``datasets`` ``save_to_disk``
directory (both with ``pyarrow``), or a Hugging Face ``datasets`` object."""

from __future__ import annotations

import csv
import json
import os
from typing import Any, Union

from .errors import HFConfigError, require

Rows = list[dict[str, Any]]
FORMATS = (".jsonl", ".json", ".csv", ".tsv", ".parquet")


def read_rows(source: Union[str, Any], key: str = "train_file") -> Rows:
    """All rows of ``source``: a ``.jsonl``/``.json`` (one object per line), ``.csv``/``.tsv``
    (named columns), ``.parquet``, a directory written by ``datasets``' ``save_to_disk``,
    or a ``datasets.Dataset``. ``key`` names the config key in errors."""
    if not isinstance(source, str):  # a datasets.Dataset (or any sequence of dicts)
        return [dict(row) for row in source]
    if os.path.isdir(source):
        return _saved_dataset(source, key)
    if not os.path.isfile(source):
        raise HFConfigError(f"data.init_args.{key}: no file '{source}'; give a .jsonl, .csv "
                            "or .parquet file (a path from the directory you run in)")
    ext = os.path.splitext(source)[1].lower()
    if ext not in FORMATS:
        raise HFConfigError(f"data.init_args.{key}: '{source}' is not one of "
                            f"{', '.join(FORMATS)}; convert it to JSON lines")
    if ext == ".parquet":
        pq = require("pyarrow.parquet")
        return pq.read_table(source).to_pylist()
    with open(source, encoding="utf-8", newline="") as fh:
        if ext in (".csv", ".tsv"):
            return list(csv.DictReader(fh, delimiter="\t" if ext == ".tsv" else ","))
        rows = []
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise HFConfigError(f"data.init_args.{key}: {source} line {n} is not JSON "
                                    f"({exc.msg}); write one JSON object per line") from None
    return rows


def _saved_dataset(path: str, key: str) -> Rows:
    """The rows of a ``Dataset.save_to_disk`` directory: its Arrow files in the order its
    ``state.json`` lists them (read with pyarrow; ``datasets`` is not needed)."""
    pa = require("pyarrow")
    state_file = os.path.join(path, "state.json")
    if not os.path.isfile(state_file):
        splits = os.path.join(path, "dataset_dict.json")
        if os.path.isfile(splits):
            with open(splits) as fh:
                names = json.load(fh).get("splits", [])
            raise HFConfigError(f"data.init_args.{key}: '{path}' holds several splits "
                                f"({', '.join(names)}); give one of them, e.g. "
                                f"{os.path.join(path, names[0] if names else 'train')}")
        raise HFConfigError(f"data.init_args.{key}: '{path}' is a directory without "
                            "state.json; give a file, or a directory written by "
                            "datasets' save_to_disk")
    with open(state_file) as fh:
        state = json.load(fh)
    rows: Rows = []
    for entry in state.get("_data_files", []):
        with pa.memory_map(os.path.join(path, entry["filename"])) as stream:
            rows.extend(pa.ipc.open_stream(stream).read_all().to_pylist())
    return rows


def check_columns(rows: Rows, columns: dict[str, str], source: Any, key: str) -> None:
    """Every configured column is present in the first row (one line naming the missing one)."""
    if not rows:
        raise HFConfigError(f"data.init_args.{key}: {source} has no rows")
    present = sorted(rows[0])
    for option, column in columns.items():
        if column not in rows[0]:
            raise HFConfigError(
                f"data.init_args.{option} is '{column}', but {source} has no such column "
                f"(columns: {', '.join(present)}); set {option} to one of them")
