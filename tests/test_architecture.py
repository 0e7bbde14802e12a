"""The shape of the package: imports only point down the layers (between the packages and
between the trainer's rooms), features see the run only through its view, modules stay
readable, and the loop fits on one screen (see docs/architecture.md).

Every import is read with ``ast``: those under ``if TYPE_CHECKING:`` and those inside
functions count the same as the ones at the top of a module.
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import re

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

# Inside trainer/: its rooms, lower to higher. The loop (core) imports no feature; the
# composition root (compose), which builds a run from its config, sits above them all.
TRAINER = "sailfin.trainer"
TRAINER_ROOMS = {"core": 0, "features": 1, "checkpointing": 1, "safety": 1, "compose": 2}
TRAINER_TOP = 3          # sailfin/trainer/__init__.py: the public Trainer and Callback

# The rooms behind the door: they see the run as a RunView (sailfin/trainer/core/view.py,
# whose members are the allow-list of what they may read and call; add a member there,
# with its line, and to docs/architecture.md). From core they import only these modules.
BEHIND_THE_DOOR = ("features", "checkpointing", "safety")
VIEW = PACKAGE / "trainer" / "core" / "view.py"
# pymarlin_forms and validation: how a recipe's outputs are read and merged (functions of
# the recipe's values, no state of the run), which the check before step 1 uses too.
CORE_FOR_FEATURES = {"sailfin.trainer.core.callbacks", "sailfin.trainer.core.view",
                     "sailfin.trainer.core.pymarlin_forms", "sailfin.trainer.core.validation"}
# The view's members a room behind the door may assign, and which modules ("*": any).
MAY_ASSIGN = {
    "stop_reason": {"*"},  # a way to stop: early stopping, privacy's max_epsilon
    **{counter: {"sailfin.trainer.checkpointing.state"}  # resume puts the counters back
       for counter in ("global_step", "epoch", "step_in_epoch", "samples_seen",
                       "train_seconds", "last_val_step", "last_val_metrics")},
}
RUN_NAMES = {"trainer", "_trainer"}  # how the rooms behind the door name the run


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


# -- the trainer's rooms ----------------------------------------------------------------
def room_of(module: str) -> tuple[str, int]:
    """(room, level) of a module inside sailfin.trainer; a name imported from the package
    itself (``from .. import Trainer``) is the package's top."""
    parts = module.split(".")
    if len(parts) > 2 and parts[2] in TRAINER_ROOMS:
        return parts[2], TRAINER_ROOMS[parts[2]]
    return "trainer", TRAINER_TOP


def upward_in_trainer(source: str, name: str, is_package: bool = False) -> list[str]:
    here, level = room_of(name)
    wrong = []
    for line, target in imported(source, name, is_package):
        if target != TRAINER and not target.startswith(TRAINER + "."):
            continue
        there, target_level = room_of(target)
        if there != here and target_level > level:
            wrong.append(f"{name}:{line} (trainer/{here}) imports {target} (trainer/{there})")
    return wrong


def trainer_modules() -> list[pathlib.Path]:
    return sorted((PACKAGE / "trainer").rglob("*.py"))


def test_the_room_table_names_every_room_of_the_trainer():
    rooms = {p.name for p in (PACKAGE / "trainer").iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in (PACKAGE / "trainer").glob("*.py")} - {"__init__"}
    assert rooms == set(TRAINER_ROOMS) and not modules, (
        "place each room of sailfin/trainer/ in TRAINER_ROOMS (a module beside the rooms "
        f"belongs in one): rooms {sorted(rooms)}, modules {sorted(modules)}")


def test_the_trainer_rooms_import_only_down():
    wrong = []
    for path in trainer_modules():
        wrong += upward_in_trainer(path.read_text(), module_name(path),
                                   path.name == "__init__.py")
    assert not wrong, ("a room of the trainer imports a higher one (core imports no feature; "
                       "only compose assembles them):\n" + "\n".join(wrong))


def test_upward_imports_inside_the_trainer_are_found():
    source = ("from typing import TYPE_CHECKING\nfrom .callbacks import Callback\n"
              "if TYPE_CHECKING:\n    from ..features.ema import WeightAverage\n"
              "def f():\n    from ..compose.setup import build_run\n"
              "    from .. import Trainer\n")
    assert upward_in_trainer(source, "sailfin.trainer.core.probe") == [
        "sailfin.trainer.core.probe:4 (trainer/core) imports sailfin.trainer.features.ema "
        "(trainer/features)",
        "sailfin.trainer.core.probe:6 (trainer/core) imports sailfin.trainer.compose.setup "
        "(trainer/compose)",
        "sailfin.trainer.core.probe:7 (trainer/core) imports sailfin.trainer.Trainer (trainer/trainer)"]
    # features may use each other's rooms and core; compose anything in the trainer
    assert upward_in_trainer("from ..checkpointing.saver import CheckpointCallback\n"
                             "from ..core.view import RunView\n",
                             "sailfin.trainer.safety.probe") == []
    assert upward_in_trainer("from ..features.ema import WeightAverage\n",
                             "sailfin.trainer.compose.probe") == []


# -- the door: what a feature may read and call -------------------------------------------
def view_members() -> set[str]:
    """The members of RunView (core/view.py): its annotated attributes and its methods."""
    tree = ast.parse(VIEW.read_text())
    view = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RunView")
    return {n.target.id if isinstance(n, ast.AnnAssign) else n.name for n in view.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            or isinstance(n, ast.FunctionDef)}


def _is_run(node: ast.AST) -> bool:
    """``trainer`` or ``self._trainer``: the run a hook was given."""
    return (isinstance(node, ast.Name) and node.id in RUN_NAMES
            or isinstance(node, ast.Attribute) and node.attr in RUN_NAMES)


def past_the_door(source: str, name: str, members: set[str]) -> list[str]:
    """Every reach of module ``name`` past the view: a name it reads, calls or assigns on
    the run that RunView does not list (or that MAY_ASSIGN does not let it assign), and
    an import of a core module that is not for features."""
    wrong: list[tuple[int, str]] = []
    for line, target in imported(source, name):
        if target.startswith(TRAINER + ".core") and target not in CORE_FOR_FEATURES:
            wrong.append((line, f"{name}:{line} imports {target} (features see the run as RunView; "
                         f"from core: {sorted(CORE_FOR_FEATURES)})"))
    for node in ast.walk(ast.parse(source, name)):
        attr, store = None, False
        if isinstance(node, ast.Attribute) and _is_run(node.value):
            attr, store = node.attr, isinstance(node.ctx, (ast.Store, ast.Del))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
              and len(node.args) >= 2 and _is_run(node.args[0])
              and isinstance(node.args[1], ast.Constant)):
            attr, store = node.args[1].value, node.func.id in ("setattr", "delattr")
        if attr is None:
            continue
        if attr not in members:
            wrong.append((node.lineno, f"{name}:{node.lineno} reads trainer.{attr}, which "
                          "RunView does not list (sailfin/trainer/core/view.py)"))
        elif store and not MAY_ASSIGN.get(attr, set()) & {"*", name}:
            wrong.append((node.lineno, f"{name}:{node.lineno} assigns trainer.{attr} "
                          "(MAY_ASSIGN in tests/test_architecture.py says who may)"))
    return [message for _, message in sorted(wrong)]


def test_features_see_the_run_only_through_its_view():
    members, wrong = view_members(), []
    for room in BEHIND_THE_DOOR:
        for path in sorted((PACKAGE / "trainer" / room).rglob("*.py")):
            wrong += past_the_door(path.read_text(), module_name(path), members)
    assert not wrong, "a feature reaches past RunView:\n" + "\n".join(wrong)


def test_reaches_past_the_view_are_found():
    source = ("from ..core.trainer import Loop\nfrom ..core.view import RunView\n"
              "def on_step_end(self, trainer):\n    trainer.global_step\n"
              "    trainer._on_end_val_epoch(1)\n    getattr(trainer, 'train_loader', None)\n"
              "    trainer.stop_reason = {}\n    trainer.epoch = 2\n"
              "    self._trainer.plan\n")
    assert past_the_door(source, "sailfin.trainer.features.probe", view_members()) == [
        "sailfin.trainer.features.probe:1 imports sailfin.trainer.core.trainer (features see "
        "the run as RunView; from core: ['sailfin.trainer.core.callbacks', "
        "'sailfin.trainer.core.pymarlin_forms', 'sailfin.trainer.core.validation', "
        "'sailfin.trainer.core.view'])",
        "sailfin.trainer.features.probe:5 reads trainer._on_end_val_epoch, which RunView "
        "does not list (sailfin/trainer/core/view.py)",
        "sailfin.trainer.features.probe:6 reads trainer.train_loader, which RunView does not "
        "list (sailfin/trainer/core/view.py)",
        "sailfin.trainer.features.probe:8 assigns trainer.epoch (MAY_ASSIGN in "
        "tests/test_architecture.py says who may)"]


def test_the_view_is_what_the_trainer_has_and_what_the_docs_list():
    from sailfin.trainer import Trainer

    members = view_members()
    assert set(MAY_ASSIGN) <= members
    # Each member is a method or property of the Trainer, a field of its Run, or set by
    # the loop or by the composition root (``self.x =`` / ``trainer.x =``).
    from typing import get_type_hints

    from sailfin.trainer.core.run import Run

    defined = {n for cls in Trainer.__mro__ for n in vars(cls)} | set(get_type_hints(Run))
    source = "\n".join(p.read_text() for p in [PACKAGE / "trainer" / "core" / "trainer.py",
                                               *(PACKAGE / "trainer" / "compose").glob("*.py")])
    missing = sorted(n for n in members - defined
                     if not re.search(rf"\b(self|trainer)\.{n}\b\s*[:=,]", source))
    assert not missing, f"RunView lists what the trainer never has: {missing}"
    docs = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    section = docs[docs.index("## What a feature sees"):][3:]
    section = section[:section.index("\n## ")]
    undocumented = sorted(n for n in members if f"`{n}" not in section)
    assert not undocumented, f"docs/architecture.md does not list RunView's {undocumented}"


def lines_of(path: pathlib.Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in path.rglob("*.py"))


@pytest.mark.parametrize("pattern, path", [
    (r"sailfin is about ([\d,]+) lines", PACKAGE),
    (r"`sailfin/config/` \(about ([\d,]+) lines", PACKAGE / "config"),
])
def test_the_sizes_docs_architecture_gives_are_measured(pattern, path):
    docs = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    found = re.search(pattern, docs)
    assert found, f"docs/architecture.md no longer says /{pattern}/: update this test"
    said, measured = int(found.group(1).replace(",", "")), lines_of(path)
    assert abs(said - measured) <= 0.15 * measured, (
        f"docs/architecture.md says {said:,} lines for {path.relative_to(PACKAGE.parent)}/, "
        f"which has {measured:,}: write about {round(measured, -2):,}")


def test_ddp_and_fsdp_are_siblings_under_the_process_group_base():
    from sailfin.backends.ddp import DDPStrategy
    from sailfin.backends.fsdp import FSDPStrategy
    from sailfin.backends.parallel import ParallelStrategy

    assert DDPStrategy.__bases__ == (ParallelStrategy,)
    assert FSDPStrategy.__bases__ == (ParallelStrategy,)


def test_no_method_skips_a_parent_with_two_argument_super():
    """``super(Parent, self)`` jumps over ``Parent``'s own method: a class in the wrong
    place in the tree."""
    found = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
             for path in modules()
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id == "super" and node.args]
    assert not found, f"two-argument super() in {found}"


# -- the run's state in plain sight ----------------------------------------------------------
COMPOSE = PACKAGE / "trainer" / "compose"


def assigned_on_the_run(tree: ast.AST) -> set[str]:
    """The names a composition-root module sets on the trainer from outside it
    (``trainer.x = ...``, ``trainer.a, trainer.b = ...``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                            and t.value.id == "trainer"):
                        names.add(t.attr)
    return names


def test_every_piece_the_composition_root_sets_is_a_typed_field_of_the_loop():
    from typing import get_type_hints

    from sailfin.trainer import Trainer
    from sailfin.trainer.core.trainer import Loop

    declared = set(get_type_hints(Loop)) | set(get_type_hints(Trainer))
    set_outside = set().union(*(assigned_on_the_run(ast.parse(p.read_text()))
                                 for p in sorted(COMPOSE.glob("*.py"))))
    assert "writers" in set_outside  # the scan sees start_run's assignments
    undeclared = sorted(set_outside - declared)
    assert not undeclared, (f"the composition root sets {undeclared} on the trainer: make "
                            "each a typed field of Run (sailfin/trainer/core/run.py)")


def test_build_run_returns_the_run_and_the_loop_takes_every_piece_of_it(tmp_path, monkeypatch):
    """build_run sets nothing on the trainer: it returns a Run, whose every field the
    loop then holds; start_run changes only what the resume sets."""
    from dataclasses import fields

    from tests.recipes import IdData, LinearRecipe, args

    from sailfin.trainer import Trainer
    from sailfin.trainer.compose import setup as compose_setup
    from sailfin.trainer.compose import trainer as compose
    from sailfin.trainer.core.run import Run

    source = (COMPOSE / "setup.py").read_text()
    build = next(n for n in ast.parse(source).body
                 if isinstance(n, ast.FunctionDef) and n.name == "build_run")
    assert assigned_on_the_run(build) == set()
    assert compose_setup.CALLBACK_ORDER[-1] == "observers"  # start_run appends them last
    built = []

    def spy(trainer):
        built.append(compose_setup.build_run(trainer))
        return built[-1]

    monkeypatch.setattr(compose, "build_run", spy)
    trainer = Trainer(LinearRecipe(IdData(20, 0)), args(tmp_path / "run"))
    try:
        trainer.setup()
        run, = built
        assert isinstance(run, Run)
        resumed = {"writers", "resumed_from", "callbacks"}  # what start_run sets
        for piece in fields(Run):
            if piece.name not in resumed:
                assert getattr(trainer, piece.name) is getattr(run, piece.name), piece.name
        assert trainer.callbacks[:len(run.callbacks)] == run.callbacks
    finally:
        trainer.close()


def test_the_loop_has_no_stub_for_a_subclass_to_fill():
    stubs = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
             for path in sorted((PACKAGE / "trainer").rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Raise) and node.exc is not None
             and "NotImplementedError" in ast.unparse(node.exc)]
    assert not stubs, f"NotImplementedError raised in {stubs}"


def test_the_view_gives_each_piece_of_the_run_the_runs_own_type():
    """RunView repeats the types of the Run fields features read (a Protocol cannot
    inherit a dataclass): the two declarations must agree."""
    from typing import get_type_hints

    from sailfin.trainer.core.run import Run
    from sailfin.trainer.core.view import RunView

    run, view = get_type_hints(Run), get_type_hints(RunView)
    shared = sorted(set(run) & set(view))
    assert "plan" in shared and "optimizers" in shared
    differ = [f"{name}: Run {run[name]}, RunView {view[name]}" for name in shared
              if run[name] != view[name]]
    assert not differ, "RunView and Run disagree:\n" + "\n".join(differ)


def test_the_views_members_have_real_types():
    from typing import Any, get_type_hints

    from sailfin.trainer.core.view import RunView

    untyped = sorted(n for n, hint in get_type_hints(RunView).items() if hint is Any)
    assert not untyped, f"RunView's {untyped} are typed Any"


def test_the_callbacks_are_ordered_by_the_list_the_composition_root_builds(tmp_path):
    """Only build_run orders the callbacks (CALLBACK_ORDER); the order in effect is it."""
    from tests.recipes import IdData, LinearRecipe, args

    from sailfin.trainer import Trainer
    from sailfin.trainer.checkpointing.saver import CheckpointCallback
    from sailfin.trainer.compose.setup import CALLBACK_ORDER, in_order
    from sailfin.trainer.features.ema import WeightAverage
    from sailfin.trainer.features.run_stats import RunStats
    from sailfin.trainer.features.time_account import TimeAccount

    outside = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
               for path in modules() if path != COMPOSE / "setup.py"
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Attribute) and node.attr == "callbacks"
               and isinstance(node.ctx, ast.Store) and path.parent.name != "core"]
    assert not outside, f"callbacks assigned outside build_run: {outside}"
    with pytest.raises(ValueError, match="no place in CALLBACK_ORDER"):
        in_order({"somewhere": []})
    trainer = Trainer(LinearRecipe(IdData(20, 0)),
                      args(tmp_path, ema={"decay": 0.9}, checkpoint={"every_n_steps": 1}))
    try:
        trainer.setup()
        places = [next(i for i, c in enumerate(trainer.callbacks) if isinstance(c, kind))
                  for kind in (WeightAverage, RunStats, CheckpointCallback, TimeAccount)]
        assert places == sorted(places), [type(c).__name__ for c in trainer.callbacks]
        assert CALLBACK_ORDER.index("features") < CALLBACK_ORDER.index("saver") \
            < CALLBACK_ORDER.index("time_account") < CALLBACK_ORDER.index("observers")
    finally:
        trainer.close()
