"""sailfin's uses of private attributes of other libraries live in ``sailfin/compat/`` (one
module per library): the installed versions still have each one, and the syntax trees of
every other sailfin module reach none.

Every module in ``sailfin/compat/`` defines ``missing() -> list[str]``: the dotted names
of the private attributes it uses that the installed version lacks. A module found here
is checked without being listed, so a new one is covered the day it lands.

The scan (:func:`private_uses`) reads each module outside ``compat/`` with ``ast`` and
reports, wherever it sits (top level, a function, under ``TYPE_CHECKING``):

- an import of a private module or name of a third-party library
  (``import torch._dynamo``, ``from torch.utils.data._utils.collate import ...``,
  ``from torch.distributed.distributed_c10d import _get_default_store``);
- a ``_name`` in an attribute chain rooted at a name imported from a third-party
  library (``torch._foreach_lerp_``, ``dist.distributed_c10d._get_default_store``);
- ``x._name`` or ``getattr(x, "_name")`` on any object, where ``_name`` is a private
  attribute of the objects sailfin handles from torch, Opacus and transformers (a module,
  tensor, optimizer, scaler, loader, state dict, ...; :func:`third_party_private_names`),
  unless the module assigns ``self._name`` itself (then it is the module's own).

A third-party library is any top-level module that is neither sailfin nor in Python's
standard library (``os._exit`` is the standard library's public way out).
"""

from __future__ import annotations

import ast
import functools
import importlib
import pathlib
import sys

import pytest
import torch

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "sailfin"
COMPAT = PACKAGE / "compat"
MODULES = sorted(p.stem for p in COMPAT.glob("*.py") if p.stem != "__init__")

# Modules the scan skips for now, each with why.
NOT_SCANNED: set[str] = set()


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def is_third_party(module: str) -> bool:
    top = module.split(".")[0]
    return bool(top) and top != "sailfin" and top not in sys.stdlib_module_names


@functools.lru_cache(maxsize=None)
def third_party_private_names() -> frozenset[str]:
    """The private attribute names (class and instance) of the third-party objects sailfin
    handles: reaching one of them on any object is reaching into the library."""
    import torch.utils.data as data
    from torch import nn
    from torch.distributed.fsdp import FSDPModule

    param = nn.Parameter(torch.zeros(1))
    sgd = torch.optim.SGD([param], lr=0.1)
    objects: list[object] = [
        nn.Linear(1, 1), nn.Linear(1, 1).state_dict(), torch.zeros(1), param, sgd,
        torch.amp.GradScaler("cpu"), data.DataLoader([1]), torch.Generator(), FSDPModule,
        torch.optim.lr_scheduler.LambdaLR(sgd, lambda step: 1.0)]
    try:
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer
        objects += [GradSampleModule(nn.Linear(1, 1)),
                    DPOptimizer(torch.optim.SGD([param], lr=0.1), noise_multiplier=0.0,
                                max_grad_norm=1.0, expected_batch_size=1)]
    except ImportError:
        pass
    try:
        import transformers
        objects.append(transformers.PreTrainedModel)
    except ImportError:
        pass
    return frozenset(name for obj in objects
                     for name in (*dir(obj), *getattr(obj, "__dict__", {})) if is_private(name))


def chain(node: ast.expr) -> tuple[str | None, list[str]]:
    """(the root name, the attributes after it) of ``a.b.c``; root None if not a name."""
    attrs: list[str] = []
    while isinstance(node, ast.Attribute):
        attrs.insert(0, node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), attrs


def private_uses(source: str, private_names: frozenset[str]) -> list[tuple[int, str]]:
    """(line, what) of each use of a third-party private name in ``source``."""
    tree = ast.parse(source)
    imported: set[str] = set()   # names bound to a third-party module or object
    own: set[str] = set()        # self._x the module assigns: its own attributes
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if is_third_party(alias.name):
                    imported.add(alias.asname or alias.name.split(".")[0])
                    if any(is_private(p) for p in alias.name.split(".")):
                        found.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and not node.level and is_third_party(node.module or ""):
            for alias in node.names:
                imported.add(alias.asname or alias.name)
                if any(is_private(p) for p in [*node.module.split("."), alias.name]):
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for t in ast.walk(target):
                    if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                            and t.value.id == "self"):
                        own.add(t.attr)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            root, attrs = chain(node)
            if root in imported and any(is_private(a) for a in attrs):
                found.append((node.lineno, ".".join([root, *attrs])))
                continue
        if isinstance(node, ast.Attribute) and node.attr in private_names:
            base = node.value
            if not (isinstance(base, ast.Name) and base.id in ("self", "cls") and node.attr in own):
                found.append((node.lineno, f"._{node.attr.lstrip('_')}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
              and node.args[1].value in private_names):
            found.append((node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"))
    return sorted(set(found))


def test_no_module_outside_compat_reaches_a_private_name_of_another_library():
    names = third_party_private_names()
    outside = [f"sailfin/{path.relative_to(PACKAGE)}:{line}: {what}"
               for path in sorted(PACKAGE.rglob("*.py"))
               if COMPAT not in path.parents
               and str(path.relative_to(PACKAGE)) not in NOT_SCANNED
               for line, what in private_uses(path.read_text(), names)]
    assert not outside, ("reach these through sailfin/compat/ (one function each, with "
                         "the public alternative), or use the public API:\n" + "\n".join(outside))


def test_the_modules_not_scanned_exist():
    """An exception outlives its reason no longer than its file."""
    assert all((PACKAGE / name).is_file() for name in NOT_SCANNED)


@pytest.mark.parametrize("source", [
    "import torch._dynamo",
    "from torch._dynamo.exc import TorchDynamoException",
    "from torch.utils.data._utils.collate import default_collate",
    "from torch.distributed.distributed_c10d import _get_default_store",
    "import torch\ntorch._foreach_lerp_([], [], 0.5)",
    "import torch.distributed as dist\ndist.distributed_c10d._get_default_store()",
    "def f(sub):\n    return sub._non_persistent_buffers_set",
    "def f(module):\n    return module._parameters.values()",
    "def f(model):\n    return getattr(model, '_no_split_modules', None)",
    "def f(optimizer):\n    optimizer._step_skip_queue.clear()",
    "class M:\n    def f(self):\n        return self._parameters",
])
def test_the_scan_finds_a_private_use(source):
    assert private_uses(source, third_party_private_names())


@pytest.mark.parametrize("source", [
    "import os\nos._exit(1)",
    "from torch.utils.data import default_collate",
    "class Staging:\n    def __init__(self):\n        self._buffers = {}\n"
    "    def size(self):\n        return len(self._buffers)",
    "def f(reader):\n    reader._read()",
    "from . import _private\n_private.x",
])
def test_the_scan_leaves_sailfins_own_names_alone(source):
    assert private_uses(source, third_party_private_names()) == []


def test_the_compat_package_holds_the_modules():
    assert {"torch", "fsdp", "opacus", "transformers"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_the_installed_library_has_every_private_attribute_sailfin_uses(name):
    module = importlib.import_module(f"sailfin.compat.{name}")
    assert callable(getattr(module, "missing", None)), (
        f"sailfin/compat/{name}.py defines no missing(): each compat module names the "
        "private attributes the installed version lacks")
    lacking = module.missing()
    assert lacking == [], (
        f"the installed library lacks {', '.join(lacking)}, which sailfin uses "
        f"(sailfin/compat/{name}.py names the public alternative or upstream issue)")


def test_missing_names_an_attribute_the_installed_torch_lacks(monkeypatch):
    from sailfin.compat import torch as compat

    assert compat.missing() == []
    monkeypatch.delattr(torch.amp.GradScaler, "_found_inf_per_device")
    assert compat.missing() == ["torch.amp.GradScaler._found_inf_per_device"]


def test_missing_names_a_private_module_the_installed_torch_lacks(monkeypatch):
    from sailfin.compat import torch as compat

    monkeypatch.setattr(compat, "PRIVATE", ("torch.distributed.checkpoint._no_such_module.X",
                                            "torch.no_such_attribute"))
    assert compat.missing() == ["torch.distributed.checkpoint._no_such_module.X",
                                "torch.no_such_attribute"]


def test_missing_names_an_attribute_the_installed_transformers_lacks(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from sailfin.compat import transformers as compat

    assert compat.missing() == []
    monkeypatch.delattr(transformers.PreTrainedModel, "_no_split_modules")
    assert compat.missing() == ["transformers.PreTrainedModel._no_split_modules"]


def test_found_inf_per_device_says_whether_the_scaler_skipped_the_step():
    """The effect sailfin relies on: after step(), the flags say a step with an inf
    gradient was skipped and a finite one was taken."""
    from sailfin.compat.torch import found_inf_per_device

    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    for grad, skipped in ((torch.tensor([1.0, float("inf")]), True),
                          (torch.tensor([2.0, 2.0]), False)):
        before = param.detach().clone()
        scaler.scale((param * grad).sum()).backward()  # the gradient is grad, scaled
        scaler.step(optimizer)
        flags = found_inf_per_device(scaler, optimizer)
        assert any(bool(v.item()) for v in flags.values()) is skipped
        assert torch.equal(param.detach(), before) is skipped
        scaler.update()
        optimizer.zero_grad()


def test_lerp_all_moves_each_end_toward_its_target():
    from sailfin.compat.torch import lerp_all_

    ends = [torch.zeros(2), torch.full((3,), 4.0)]
    lerp_all_(ends, [torch.full((2,), 10.0), torch.zeros(3)], 0.25)
    assert torch.equal(ends[0], torch.full((2,), 2.5))
    assert torch.equal(ends[1], torch.full((3,), 3.0))


def test_no_split_modules_reads_a_hugging_face_models_blocks():
    from sailfin.compat.transformers import no_split_modules

    class Declares(torch.nn.Module):
        _no_split_modules = ["Block"]

    assert no_split_modules(Declares()) == ["Block"]
    assert no_split_modules(torch.nn.Linear(1, 1)) == []


FULL_DISK_SAVE = """
import gc, sys, torch
import torch.distributed.checkpoint as dcp
from sailfin.compat.torch import streams_flushable_after_close

writer = dcp.FileSystemWriter(sys.argv[1], single_file_per_rank=True, thread_count=1)
if sys.argv[2] == "fixed":
    streams_flushable_after_close(writer)
try:
    dcp.save({"w": torch.ones(100_000)}, storage_writer=writer, no_dist=True)
except BaseException as exc:  # DCP's CheckpointException is a BaseException
    print("save failed:", "No space left on device" in str(exc))
gc.collect()
"""


@pytest.mark.skipif(not pathlib.Path("/dev/full").exists(), reason="no /dev/full here")
@pytest.mark.parametrize("writer", ["torch's", "fixed"])
def test_a_full_disk_under_dcp_prints_nothing_at_finalisation(tmp_path, writer):
    """DCP's NoCloseWriter flushes its file again when collected, after the failed write
    closed it: Python 3.13 prints that error (earlier Pythons in -X dev mode, as here)."""
    import subprocess

    target = tmp_path / "ck"
    target.mkdir()
    (target / "__0_0.distcp").symlink_to("/dev/full")  # every write: ENOSPC
    done = subprocess.run([sys.executable, "-X", "dev", "-W", "ignore", "-c", FULL_DISK_SAVE,
                           str(target), writer], capture_output=True, text=True, timeout=300,
                          cwd=PACKAGE.parent)
    assert "save failed: True" in done.stdout, done.stdout + done.stderr
    printed = "Exception ignored" in done.stderr and "flush of closed file" in done.stderr
    assert printed == (writer == "torch's"), done.stderr[-3000:]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_streams_flushable_after_close_writes_what_dcp_reads_back(tmp_path):
    import torch.distributed.checkpoint as dcp

    from sailfin.compat.torch import streams_flushable_after_close

    state = {"w": torch.arange(1000.0), "b": {"x": torch.ones(3)}}
    writer = dcp.FileSystemWriter(str(tmp_path), single_file_per_rank=True)
    dcp.save(state, storage_writer=streams_flushable_after_close(writer), no_dist=True)
    back = {"w": torch.zeros(1000), "b": {"x": torch.zeros(3)}}
    dcp.load(back, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"]["x"], state["b"]["x"])
