"""The shape of the package: imports only point down the layers, modules stay readable,
and the loop fits on one screen (see docs/architecture.md).

Every import is read with ``ast``: those under ``if TYPE_CHECKING:`` and those inside
functions count the same as the ones at the top of a module.
"""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "sailfin"

# Higher imports lower (or the same), never the other way round.
LAYERS = {
    "cli": 9, "report": 9, "shard_cli": 9, "__main__": 9,
    "trainer": 7,
    "backends": 6,
    "checkpoint": 5,
    "data": 4, "interfaces": 4,
    "logging": 3,
    "distributed": 2,
    "config": 1, "utils": 1, "version": 1,
    "compat": 1,
}
TOP = "sailfin"          # sailfin/__init__.py: the public API, above the trainer
TOP_LEVEL = 8
INTEGRATION = 8          # sailfin.hf and any other top-level module not named above
ENTRY_POINTS = {"cli", "report", "shard_cli", "__main__"}
MAX_LINES = 400
MAX_LOOP_LINES = 60


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


def imported(source: str, name: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module) of every sailfin import in module ``name``'s source,
    wherever it sits."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if node.module is None or node.level and not node.module:
                # ``from . import x``: x may be a module; judge each name.
                found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, target))
    return [(line, mod) for line, mod in found if mod == TOP or mod.startswith(TOP + ".")]


def layer_of(module: str) -> tuple[str, int]:
    parts = module.split(".")
    if len(parts) == 1:
        return TOP, TOP_LEVEL
    first = parts[1]
    return first, LAYERS.get(first, INTEGRATION)


def test_layer_table_names_every_top_level_piece():
    """A new top-level piece is an integration unless the table places it."""
    names = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").exists()) and p.name != "__init__.py"}
    assert set(LAYERS) - {"__main__"} <= names | {"__main__"}


def upward_imports(source: str, name: str, is_package: bool = False) -> list[str]:
    here, level = layer_of(name)
    wrong = []
    for line, target in imported(source, name, is_package):
        there, target_level = layer_of(target)
        if there == here:
            continue
        if level == INTEGRATION and here not in LAYERS and here != TOP:
            ok = there not in ENTRY_POINTS  # integrations: the public API, not the CLI
        else:
            ok = target_level <= level
        if not ok:
            wrong.append(f"{name}:{line} ({here}) imports {target} ({there})")
    return wrong


def test_imports_only_point_down():
    wrong = []
    for path in modules():
        wrong += upward_imports(path.read_text(), module_name(path), path.name == "__init__.py")
    assert not wrong, "a lower layer imports a higher one:\n" + "\n".join(wrong)


def test_upward_imports_are_found_under_type_checking_and_in_functions():
    source = ("from typing import TYPE_CHECKING\nfrom .errors import CheckpointError\n"
              "if TYPE_CHECKING:\n    from ..trainer import Trainer\n"
              "def f():\n    from ..trainer.core import trainer\n"
              "    import sailfin.cli\n")
    assert upward_imports(source, "sailfin.checkpoint.probe") == [
        "sailfin.checkpoint.probe:4 (checkpoint) imports sailfin.trainer (trainer)",
        "sailfin.checkpoint.probe:6 (checkpoint) imports sailfin.trainer.core (trainer)",
        "sailfin.checkpoint.probe:7 (checkpoint) imports sailfin.cli (cli)"]
    # the trainer may import the checkpoint layer; an integration anything but the CLI
    assert upward_imports("from ..checkpoint import Checkpointer\n",
                          "sailfin.trainer.probe") == []
    assert upward_imports("from .trainer import Trainer\nfrom . import cli\n", "sailfin.hf",
                          ) == ["sailfin.hf:2 (hf) imports sailfin.cli (cli)"]


def test_no_module_passes_400_lines():
    long = [f"{p.relative_to(PACKAGE.parent)}: {n} lines" for p in modules()
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines:\n" + "\n".join(long)


@pytest.mark.parametrize("name", ["train", "_train_epoch"])
def test_train_and_the_epoch_loop_fit_on_one_screen(name):
    from sailfin.trainer import Trainer

    lines, _ = inspect.getsourcelines(getattr(Trainer, name))
    assert len(lines) <= MAX_LOOP_LINES, f"Trainer.{name} is {len(lines)} lines"
