"""``sailfin train --help``: every ``trainer.`` key with its type, default and one line of
doc, generated from the schema (the dataclasses and the docstring under each field).

Example::

    print(trainer_keys_help())   # "  --trainer.epochs  int = 1"...
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
from typing import Any

from .trainer import BACKENDS, TrainerArguments


def field_docs(cls: type) -> dict[str, str]:
    """The first line of the docstring under each field of dataclass ``cls`` (or '')."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            text = ""
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                    and isinstance(after.value.value, str):
                text = first_sentence(" ".join(after.value.value.split()))
            docs[node.target.id] = text
    return docs


# A sentence ends at a period and a space (or the end); not the one of "e.g." or "i.e.".
_SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)\.\s+")


def first_sentence(text: str) -> str:
    """The first sentence of ``text``, without its final period."""
    return _SENTENCE_END.split(text, 1)[0].rstrip().rstrip(".")


# Keys whose values are names from a list in code: the help shows the list itself.
CHOICES: dict[str, tuple[str, ...]] = {"trainer.backend": ("auto", *BACKENDS)}


def trainer_keys_help(defaults: Any = None, prefix: str = "trainer.") -> str:
    """One line per key of ``defaults`` (a ``TrainerArguments()``), nested sections
    (``trainer.checkpoint.*``) expanded."""
    defaults = TrainerArguments() if defaults is None else defaults
    lines: list[str] = []
    docs = field_docs(type(defaults))
    for f in dataclasses.fields(defaults):
        default = getattr(defaults, f.name)
        if dataclasses.is_dataclass(default):
            lines.append(trainer_keys_help(default, f"{prefix}{f.name}."))
            continue
        kind = str(f.type).replace("typing.", "")
        doc = docs.get(f.name, "")
        if f"{prefix}{f.name}" in CHOICES:  # the list itself, where the doc names it
            doc = doc.split("; one of ")[0] + "; one of: " + ", ".join(CHOICES[prefix + f.name])
        lines.append(f"  --{prefix}{f.name}  {kind} = {default!r}" + (f"  {doc}" if doc else ""))
    return "\n".join(lines)
