"""Reading rows of text: JSON lines, CSV with a header, or a Hugging Face ``datasets`` object."""

from __future__ import annotations

import csv
import json
import os
from typing import Any, Union

from .errors import HFConfigError, require

Rows = list[dict[str, Any]]
FORMATS = (".jsonl", ".json", ".csv", ".tsv")


def read_rows(source: Union[str, Any], key: str = "train_file") -> Rows:
    """All rows of ``source``: a ``.jsonl``/``.json`` (one object per line), ``.csv``/``.tsv``
    (named columns), a directory written by ``datasets``' ``save_to_disk``, or a
    ``datasets.Dataset``. ``key`` names the config key in errors."""
    if not isinstance(source, str):  # a datasets.Dataset (or any sequence of dicts)
        return [dict(row) for row in source]
    if os.path.isdir(source):
        datasets = require("datasets")
        return [dict(row) for row in datasets.load_from_disk(source)]
    if not os.path.isfile(source):
        raise HFConfigError(f"data.init_args.{key}: no file '{source}'; give a .jsonl or .csv "
                            "file (a path from the directory you run in)")
    ext = os.path.splitext(source)[1].lower()
    if ext not in FORMATS:
        raise HFConfigError(f"data.init_args.{key}: '{source}' is not one of "
                            f"{', '.join(FORMATS)}; convert it to JSON lines")
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
