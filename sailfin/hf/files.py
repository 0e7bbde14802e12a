"""Reading rows of text: JSON lines, CSV with a header, parquet, a ``datasets`` ``save_to_disk``
directory (both with ``pyarrow``), or a Hugging Face ``datasets`` object.

Every way a file can be bad (damaged, not the format its name says, not UTF-8, a row of the
wrong shape, a pipe or a device, a data file outside its directory) is one
:class:`HFConfigError` naming the file, the row where known, and what to do.
"""

from __future__ import annotations

import csv
import io
import json
import os
import stat
from collections.abc import Mapping
from typing import Any, Optional, Union

from ..config.errors import short_repr
from ..utils.files import file_kind
from .errors import HFConfigError, require

Rows = list[dict[str, Any]]
FORMATS = (".jsonl", ".json", ".csv", ".tsv", ".parquet")


def read_rows(source: Union[str, Any], key: str = "train_file") -> Rows:
    """All rows of ``source``: a ``.jsonl``/``.json`` (one object per line), ``.csv``/``.tsv``
    (named columns), ``.parquet``, a directory written by ``datasets``' ``save_to_disk``,
    or a ``datasets.Dataset``. ``key`` names the config key in errors."""
    where = f"data.init_args.{key}"
    if not isinstance(source, str):  # a datasets.Dataset (or any sequence of dicts)
        rows = []
        for n, row in enumerate(source, 1):
            if not isinstance(row, Mapping):
                raise HFConfigError(f"{where}: row {n} of the {type(source).__name__} is a "
                                    f"{type(row).__name__}, not a mapping of columns")
            rows.append(dict(row))
        return rows
    kind = _kind(source)
    if kind == "a directory":
        return _saved_dataset(source, where)
    if kind is None:
        raise HFConfigError(f"{where}: no file '{source}'; give a .jsonl, .csv or .parquet "
                            "file (a path from the directory you run in)")
    if kind:
        raise HFConfigError(f"{where}: '{source}' is {kind}, not a regular file; give a "
                            ".jsonl, .csv or .parquet file")
    ext = os.path.splitext(source)[1].lower()
    if ext not in FORMATS:
        raise HFConfigError(f"{where}: '{source}' is not one of {', '.join(FORMATS)}; "
                            "convert it to JSON lines")
    if ext == ".parquet":
        return _parquet(source, where)
    with open(source, "rb") as fh:
        data = fh.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise HFConfigError(f"{where}: {source} line {line} is not UTF-8 text (byte "
                            f"0x{data[exc.start]:02x}); save the file as UTF-8") from None
    if ext in (".csv", ".tsv"):
        return _csv(text, source, where, "\t" if ext == ".tsv" else ",")
    return _json_lines(text, source, where)


def _json_lines(text: str, source: str, where: str) -> Rows:
    rows = []
    for n, line in enumerate(text.split("\n"), 1):  # "\n" only: JSON text may hold U+2028
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise HFConfigError(f"{where}: {source} line {n} is not JSON ({exc.msg}); write "
                                "one JSON object per line") from None
        except RecursionError:
            raise HFConfigError(f"{where}: {source} line {n} nests its values deeper than "
                                "JSON lines of text do; write one flat JSON object per line "
                                "({\"text\": ..., \"label\": ...})") from None
        if not isinstance(row, dict):
            raise HFConfigError(f"{where}: {source} line {n} is a JSON "
                                f"{_json_kind(row)}, not an object; write one JSON object per "
                                "line ({\"text\": ..., \"label\": ...})")
        rows.append(row)
    return rows


def _csv(text: str, source: str, where: str, delimiter: str) -> Rows:
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter)
    rows = []
    try:
        for row in reader:
            extra = row.get(None) or []  # DictReader's place for fields past the header
            missing = sum(v is None for k, v in row.items() if k is not None)
            if extra or missing:
                header = len(reader.fieldnames or [])
                raise HFConfigError(
                    f"{where}: {source} line {reader.line_num} has "
                    f"{header + len(extra) - missing} field(s), the header {header}; give "
                    "every row one value per column (quote a value that holds the delimiter)")
            rows.append(row)
    except csv.Error as exc:
        # The reader counts the lines of the rows it returned: the bad one is the next.
        raise HFConfigError(f"{where}: {source} line {reader.line_num + 1} cannot be read as "
                            f"CSV ({exc}); fix that row, or convert the file to JSON lines or "
                            "parquet (no limit on a text's length)") from None
    return rows


def _parquet(source: str, where: str) -> Rows:
    pa = require("pyarrow")
    pq = require("pyarrow.parquet")
    try:
        return pq.read_table(source).to_pylist()
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise HFConfigError(f"{where}: {source} is not a readable parquet file "
                            f"({_first_line(exc)}): it is damaged or another format; write "
                            "it again (pandas' to_parquet, pyarrow.parquet.write_table)"
                            ) from None


def _saved_dataset(path: str, where: str) -> Rows:
    """The rows of a ``Dataset.save_to_disk`` directory: its Arrow files in the order its
    ``state.json`` lists them (read with pyarrow; ``datasets`` is not needed). A file it
    names must be a regular file in the directory: nothing outside it, no pipe or device."""
    pa = require("pyarrow")
    state_file = os.path.join(path, "state.json")
    redo = "save the dataset again with save_to_disk"
    if _kind(state_file) is None:
        splits = os.path.join(path, "dataset_dict.json")
        if _kind(splits) == "":
            names = _json_file(splits, where).get("splits", [])
            names = [str(n) for n in names] if isinstance(names, list) else []
            raise HFConfigError(f"{where}: '{path}' holds several splits "
                                f"({', '.join(names)}); give one of them, e.g. "
                                f"{os.path.join(path, names[0] if names else 'train')}")
        raise HFConfigError(f"{where}: '{path}' is a directory without state.json; give a "
                            "file, or a directory written by datasets' save_to_disk")
    state = _json_file(state_file, where)
    entries = state.get("_data_files")
    if not (isinstance(entries, list) and entries and all(
            isinstance(e, dict) and isinstance(e.get("filename"), str) for e in entries)):
        raise HFConfigError(f"{where}: {state_file} lists no data files (its '_data_files' is "
                            f"{short_repr(entries)}); {redo}")
    root = os.path.realpath(path)
    rows: Rows = []
    for entry in entries:
        name = entry["filename"]
        full = os.path.join(path, name)
        if os.path.dirname(os.path.realpath(full)) != root:
            raise HFConfigError(f"{where}: {state_file} names {short_repr(name)}, which is "
                                f"not a file in {path}; sailfin reads nothing outside it: "
                                f"{redo}")
        kind = _kind(full)
        if kind is None or kind:
            raise HFConfigError(f"{where}: {state_file} names {name}, which "
                                + ("is missing" if kind is None else f"is {kind}, not a "
                                   "regular file") + f"; {redo}")
        try:
            with pa.memory_map(full) as stream:
                rows.extend(pa.ipc.open_stream(stream).read_all().to_pylist())
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise HFConfigError(f"{where}: {full} is not a readable Arrow stream "
                                f"({_first_line(exc)}): it is damaged; {redo}") from None
    return rows


def _json_file(path: str, where: str) -> dict:
    kind = _kind(path)
    if kind:
        raise HFConfigError(f"{where}: {path} is {kind}, not a regular file")
    with open(path, "rb") as fh:
        data = fh.read(1 << 20)  # a datasets' state file is a few hundred bytes
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise HFConfigError(f"{where}: {path} is not a JSON object as datasets' save_to_disk "
                            "writes it: it is damaged; save the dataset again with "
                            "save_to_disk")
    return value


# What each column must hold, by option and task: text where text goes in.
_TEXT = "text (a string)"
_WORDS = "a list of words (strings)"
_LABEL = "a label (a string or a number)"
_TAGS = "a list of tags (strings or numbers)"


def check_columns(rows: Rows, columns: dict[str, str], source: Any, key: str,
                  task: Optional[str] = None) -> None:
    """Every configured column is in every row and holds what ``task`` reads from it: text
    (a list of words for token classification), a label (a list of tags). One line names
    the first row that does not, and the column."""
    if not rows:
        raise HFConfigError(f"data.init_args.{key}: {source} has no rows")
    present = sorted(map(str, rows[0]))
    for option, column in columns.items():
        if column not in rows[0]:
            raise HFConfigError(
                f"data.init_args.{option} is '{column}', but {source} has no such column "
                f"(columns: {', '.join(present)}); set {option} to one of them")
    tokens = task == "token_classification"
    wants = {"text_column": _WORDS if tokens else _TEXT, "text_pair_column": _TEXT,
             "target_column": _TEXT, "label_column": _TAGS if tokens else _LABEL}
    checks = [(option, column, wants[option]) for option, column in columns.items()
              if task is not None and option in wants]
    for n, row in enumerate(rows, 1):
        for option, column, want in checks:
            value = row.get(column, _MISSING)
            if not _holds(value, want):
                got = ("no value" if value is _MISSING else "null" if value is None else
                       f"{_type_name(value)} {short_repr(value)}")
                raise HFConfigError(
                    f"data.init_args.{key}: {source} row {n}, column '{column}' holds "
                    f"{got}, not {want}; fix that row, or set data.init_args.{option} to a "
                    "column that holds them")


_MISSING = object()


def _holds(value: Any, want: str) -> bool:
    if want == _TEXT:
        return isinstance(value, str)
    if want == _WORDS:
        return isinstance(value, list) and all(isinstance(w, str) for w in value)
    if want == _LABEL:
        return _is_label(value)
    return isinstance(value, list) and all(_is_label(t) for t in value)


def _is_label(value: Any) -> bool:
    return isinstance(value, (str, int, float)) and value == value  # NaN is no label


def _type_name(value: Any) -> str:
    names = {type(None): "null", dict: "a struct", list: "a list", bytes: "binary",
             bool: "a boolean", int: "an integer", float: "a number"}
    return names.get(type(value), f"a {type(value).__name__}")


def _json_kind(value: Any) -> str:
    return {list: "array", str: "string", type(None): "null", bool: "boolean"}.get(
        type(value), "number")


def _kind(path: str) -> Optional[str]:
    """``None`` when nothing is at ``path``, ``""`` for a regular file, ``"a directory"``,
    else what it is ("a FIFO (named pipe)"...), which sailfin never opens: it may not end."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:  # a symlink loop, a name too long: say so
        return f"unreadable ({exc.strerror})"
    return "" if stat.S_ISREG(mode) else file_kind(mode)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return short_repr(text[0]).strip("'\"") if text else type(exc).__name__
