"""sailfin.compat.opacus: the private Opacus attributes sailfin uses are all there."""

import pytest

pytest.importorskip("opacus")


def test_every_private_opacus_attribute_sailfin_uses_exists():
    from sailfin.compat import opacus

    assert opacus.missing() == []


def test_missing_names_an_attribute_the_installed_opacus_lacks(monkeypatch):
    from sailfin.compat import opacus

    monkeypatch.setattr(opacus, "OPTIMIZER_ATTRIBUTES", ("_step_skip_queue", "_gone"))
    assert opacus.missing() == ["opacus.optimizers.DPOptimizer._gone"]
