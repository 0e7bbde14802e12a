"""Example data the machine already has: functions of Python's standard library.

:class:`StdlibTextData` writes JSON lines for one task and trains a byte-level BPE
tokenizer on the same text (once, into ``out_dir``). Rows: ``classification``, a
function's source -> its package; ``token_classification``, its first Python tokens
-> tags (``KW``, ``REF`` dotted names, ``STR``, ``NUM``, ``O``); ``causal_lm``, its
source; ``seq2seq``, its body -> its name as words (``read_file`` -> "read file").
"""

from __future__ import annotations

import ast
import io
import itertools
import json
import keyword
import os
import re
import sysconfig
import tokenize as pytokenize
import zlib
from typing import Any, Iterator, Optional

from ..data.shards.index import write_atomic
from .text_data import TextData
from .tokenizers import train_tokenizer

PACKAGES = ("email", "json", "http", "unittest", "xml", "logging")


def stdlib_functions(packages: tuple[str, ...] = PACKAGES, per_package: int = 200,
                     max_chars: int = 1200) -> Iterator[dict[str, Any]]:
    """``{"package", "name", "source", "body", "key"}`` for the first ``per_package``
    functions of each package (files in sorted order, functions in file order)."""
    for package in packages:
        yield from itertools.islice(_functions(package, max_chars), per_package)


def _functions(package: str, max_chars: int) -> Iterator[dict[str, Any]]:
    root = sysconfig.get_paths()["stdlib"]
    base = os.path.join(root, package)
    files = ([base + ".py"] if os.path.isfile(base + ".py") else
             sorted(os.path.join(d, f) for d, _, fs in os.walk(base) for f in fs
                    if f.endswith(".py") and "test" not in d.replace(base, "")))
    for path in files:
        try:
            text = open(path, encoding="utf-8").read()
            tree = ast.parse(text)
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        lines = _LINE.findall(text)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            source = _segment(lines, node)
            if len(source) > max_chars:
                continue
            start = node.body[0]
            if (isinstance(start, ast.Expr) and isinstance(start.value, ast.Constant)
                    and len(node.body) > 1):
                start = node.body[1]  # the body without its docstring
            body = "\n".join(source.splitlines()[start.lineno - node.lineno:])
            yield {"package": package, "name": node.name, "source": source,
                   "body": body.strip(), "key": f"{os.path.relpath(path, root)}:{node.lineno}"}


# A line with its end, cut where the parser cuts (not at form feeds, as splitlines does).
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


def _segment(lines: list[str], node: ast.AST) -> str:
    """``ast.get_source_segment(text, node)`` from lines cut once per file (the library
    call cuts the whole file again for every node: most of the examples' start-up)."""
    first, last = node.lineno - 1, node.end_lineno - 1  # type: ignore[attr-defined]
    col, end_col = node.col_offset, node.end_col_offset  # type: ignore[attr-defined]
    if first == last:
        return lines[first].encode()[col:end_col].decode()
    head = lines[first].encode()[col:].decode()
    tail = lines[last].encode()[:end_col].decode()
    return head + "".join(lines[first + 1:last]) + tail


def python_token_tags(source: str, limit: int = 48) -> tuple[list[str], list[str]]:
    """The first ``limit`` Python tokens of ``source`` and their BIO tags."""
    words: list[str] = []
    tags: list[str] = []
    try:
        for tok in pytokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type in (pytokenize.NEWLINE, pytokenize.NL, pytokenize.INDENT,
                            pytokenize.DEDENT, pytokenize.COMMENT, pytokenize.ENDMARKER):
                continue
            word = tok.string[:24]
            if tok.type == pytokenize.NAME and keyword.iskeyword(tok.string):
                tag = "B-KW"
            elif tok.type == pytokenize.NAME:
                chained = len(words) >= 2 and words[-1] == "." and tags[-1] == "I-REF"
                tag = "I-REF" if chained else "B-REF"
            elif tok.type == pytokenize.OP and tok.string == "." and tags and \
                    tags[-1] in ("B-REF", "I-REF"):
                tag = "I-REF"
            elif tok.type == pytokenize.STRING:
                tag = "B-STR"
            elif tok.type == pytokenize.NUMBER:
                tag = "B-NUM"
            else:
                tag = "O"
            words.append(word)
            tags.append(tag)
            if len(words) >= limit:
                break
    except (pytokenize.TokenError, IndentationError, SyntaxError):
        pass
    # A trailing "." that no name followed is not part of the reference.
    for i in range(len(tags)):
        if words[i] == "." and tags[i] == "I-REF" and (i + 1 == len(tags)
                                                         or tags[i + 1] != "I-REF"):
            tags[i] = "O"
    return words, tags


def write_example_files(out_dir: str, task: str, per_package: int = 200,
                        val_percent: int = 15, packages: tuple[str, ...] = PACKAGES
                        ) -> tuple[str, str]:
    """``out_dir/{task}-train.jsonl`` and ``-val.jsonl`` (split by a hash of each
    function's place, so the split never changes); written once."""
    train, val = (os.path.join(out_dir, f"{task}-{s}.jsonl") for s in ("train", "val"))
    if os.path.exists(train) and os.path.exists(val):
        return train, val
    os.makedirs(out_dir, exist_ok=True)
    parts: dict[str, list[str]] = {train: [], val: []}
    for fn in stdlib_functions(tuple(packages), per_package):
        if task == "classification":
            row: dict[str, Any] = {"text": fn["source"], "label": fn["package"]}
        elif task == "causal_lm":
            row = {"text": fn["source"]}
        elif task == "seq2seq":
            row = {"text": fn["body"], "summary": " ".join(w for w in fn["name"].split("_") if w)}
        else:
            words, tags = python_token_tags(fn["source"])
            if not words:
                continue
            row = {"words": words, "tags": tags}
        split = val if zlib.crc32(fn["key"].encode()) % 100 < val_percent else train
        parts[split].append(json.dumps(row))
    for path, lines in parts.items():
        write_atomic(path, ("\n".join(lines) + "\n").encode("utf-8"))
    return train, val


class StdlibTextData(TextData):
    """:class:`TextData` over standard-library functions for ``task`` (see the module
    docstring), with a tokenizer trained on them; files go to ``out_dir``.

    Example::

        data = StdlibTextData("classification", "outputs/hf-data", per_package=50)
    """

    def __init__(self, task: str, out_dir: str = "outputs/hf-data", per_package: int = 200,
                 packages: Optional[list[str]] = None, vocab_size: int = 2000,
                 val_percent: int = 15, **kwargs: Any) -> None:
        packages_t = tuple(packages or PACKAGES)
        train, val = write_example_files(out_dir, task, per_package, val_percent, packages_t)
        tok_dir = os.path.join(out_dir, f"tokenizer-{vocab_size}")
        if not os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
            texts = (fn["source"] for fn in stdlib_functions(packages_t, per_package))
            train_tokenizer(texts, tok_dir, vocab_size)
        if task == "token_classification":
            kwargs.setdefault("text_column", "words")
            kwargs.setdefault("label_column", "tags")
        super().__init__(tok_dir, train, val, task=task, **kwargs)
