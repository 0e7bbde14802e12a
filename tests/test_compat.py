"""sailfin's uses of private attributes of other libraries (``sailfin/compat/``, one module
per library): the installed versions still have each one, and none is used elsewhere.

Every module in ``sailfin/compat/`` defines ``missing() -> list[str]``: the dotted names
of the private attributes it uses that the installed version lacks. A module found here
is checked without being listed, so a new one is covered the day it lands.
"""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest
import torch

COMPAT = pathlib.Path(__file__).resolve().parents[1] / "sailfin" / "compat"
MODULES = sorted(p.stem for p in COMPAT.glob("*.py") if p.stem != "__init__")


def test_the_compat_package_holds_the_modules():
    assert "torch" in MODULES


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


@pytest.mark.parametrize("name", MODULES)
def test_private_names_are_used_only_in_their_compat_module(name):
    """For a module that lists its names (``PRIVATE``): each private part of them appears
    in no sailfin module outside sailfin/compat/."""
    private = getattr(importlib.import_module(f"sailfin.compat.{name}"), "PRIVATE", ())
    parts = {p for dotted in private for p in dotted.split(".") if p.startswith("_")}
    outside = [f"{path.relative_to(COMPAT.parents[1])}:{i}: {part}"
               for path in sorted(COMPAT.parent.rglob("*.py")) if COMPAT not in path.parents
               for i, line in enumerate(path.read_text().splitlines(), 1)
               for part in parts if re.search(rf"\b{re.escape(part)}\b", line)]
    assert not outside, (f"use these through sailfin/compat/{name}.py:\n" + "\n".join(outside))


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
