"""target_epsilon is a bound across resumes; epsilon the accountant cannot bound is refused;
the logged epsilon and max_epsilon read a table built once (sp-dp, in-process)."""

import hashlib
import json
import math

import pytest

from sailfin import Trainer
from sailfin.config.errors import ConfigError
from tests.checkpoint.helpers import Crash, CrashAt
from tests.checkpoint.test_memory import Settle
from tests.dp.recipes import dp_args
from tests.recipes import IdData, LinearRecipe

pytest.importorskip("opacus")
from opacus.accountants import PRVAccountant, RDPAccountant  # noqa: E402

TARGET = {"target_epsilon": 3.0, "noise_multiplier": None}
CK = {"every_n_steps": 5}


def digest(directory):
    """Every file under ``directory``, by relative path -> sha256 of its bytes."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def accountant_epsilon(history, delta=1 / 47, cls=RDPAccountant):
    acc = cls()
    acc.history = [tuple(h) for h in history]
    return acc.get_epsilon(delta=delta)


def run(out, **kw):
    module = LinearRecipe(IdData(47, 0))
    return module, Trainer(module, dp_args(out, checkpoint=CK, **kw)).train()


@pytest.mark.parametrize("epochs", [4, 8])
def test_target_epsilon_holds_when_a_resumed_run_trains_longer(tmp_path, epochs):
    _, first = run(tmp_path, epochs=2, dp=TARGET)
    assert first["global_step"] == 10 and first["privacy"]["epsilon"] <= 3.0
    spent = first["privacy"]["epsilon"]
    module, summary = run(tmp_path, epochs=epochs, dp=TARGET)
    privacy = summary["privacy"]
    assert summary["global_step"] == 5 * epochs  # it trained the new length
    segments = privacy["segments"]
    assert [s["steps"] for s in segments] == [10, 5 * epochs - 10]
    # The first segment is the checkpoint's: its noise and its epsilon are kept.
    assert segments[0]["noise_multiplier"] == first["privacy"]["noise_multiplier"]
    assert segments[0]["epsilon"] == spent
    # The second runs at more noise; the whole history, by Opacus's accountant, stays
    # within the target, and is what summary.json reports.
    assert segments[1]["noise_multiplier"] > segments[0]["noise_multiplier"]
    history = [(s["noise_multiplier"], s["sample_rate"], s["steps"]) for s in segments]
    whole = accountant_epsilon(history)
    assert spent < whole <= 3.0 and abs(privacy["epsilon"] - whole) < 1e-12
    assert privacy["accounted_steps"] == 5 * epochs
    saved = json.loads((tmp_path / "summary.json").read_text())["privacy"]
    assert saved["segments"] == segments


def test_a_resume_the_target_cannot_cover_stops_before_its_first_step(tmp_path):
    _, first = run(tmp_path, epochs=2, dp=TARGET)
    spent = first["privacy"]["epsilon"]
    before = digest(tmp_path / "checkpoints")
    module = LinearRecipe(IdData(47, 0))
    lower = {**TARGET, "target_epsilon": 2.0}  # below what the checkpoint already spent
    with pytest.raises(ConfigError) as info:
        Trainer(module, dp_args(tmp_path, epochs=4, checkpoint=CK, dp=lower)).train()
    line = str(info.value)
    assert "\n" not in line
    assert "trainer.dp.target_epsilon 2 cannot hold" in line
    assert f"already spent epsilon {spent:.6g}" in line
    would = accountant_epsilon([(first["privacy"]["noise_multiplier"], 10 / 47, 20)])
    assert f"would bring it to {would:.6g}" in line
    assert module.seen == []
    assert digest(tmp_path / "checkpoints") == before


def test_a_resume_that_changes_nothing_keeps_the_noise_and_the_bits(tmp_path):
    ref, ref_summary = run(tmp_path / "ref", epochs=3, dp=TARGET)
    with pytest.raises(Crash):  # after step 7; the checkpoint of step 5 is the latest
        Trainer(LinearRecipe(IdData(47, 0)), dp_args(tmp_path / "run", epochs=3, checkpoint=CK,
                                                      dp=TARGET), callbacks=[CrashAt(7)]).train()
    module, summary = run(tmp_path / "run", epochs=3, dp=TARGET)
    assert summary["privacy"] == ref_summary["privacy"]
    assert len(summary["privacy"]["segments"]) == 1
    for a, b in zip(ref.parameters(), module.parameters()):
        assert a.equal(b)


def test_an_unreachable_target_is_refused_before_the_first_step(tmp_path):
    module = LinearRecipe(IdData(47, 0))
    tiny = {"target_epsilon": 1e-9, "noise_multiplier": None}
    with pytest.raises(ConfigError) as info:
        Trainer(module, dp_args(tmp_path, dp=tiny)).train()
    line = str(info.value)
    assert "trainer.dp.target_epsilon 1e-09 is unreachable" in line and "\n" not in line
    assert "cannot bound an epsilon this small" in line
    assert module.seen == [] and not (tmp_path / "summary.json").exists()


@pytest.mark.parametrize("sigma, advice", [(1e4, "lower noise_multiplier"),
                                           (1e-200, "raise noise_multiplier")])
def test_an_epsilon_the_accountant_cannot_bound_is_refused(tmp_path, sigma, advice):
    module = LinearRecipe(IdData(47, 0))
    with pytest.raises(ConfigError, match=advice) as info:
        Trainer(module, dp_args(tmp_path, dp={"noise_multiplier": sigma})).train()
    assert "trainer.dp.noise_multiplier" in str(info.value) and module.seen == []


def test_reported_epsilon_is_never_below_zero(tmp_path):
    """At large noise the accountant's first steps come out negative; the run ends above
    0. What is logged and reported is the accountant's figure, or 0 where it is lower."""
    summary = Trainer(LinearRecipe(IdData(47, 0)), dp_args(
        tmp_path, epochs=30, dp={"noise_multiplier": 8.0})).train()
    logged = [json.loads(x)["epsilon"] for x in (tmp_path / "metrics.jsonl").read_text()
              .splitlines() if "epsilon" in x]
    raw = [accountant_epsilon([(8.0, 10 / 47, k)]) for k in range(1, len(logged) + 1)]
    assert min(raw) < 0 < raw[-1]  # the case this test is about
    assert logged == [max(0.0, r) for r in raw]
    assert summary["privacy"]["epsilon"] == raw[-1]


def test_prv_accountant_figures_equal_opacus(tmp_path):
    summary = Trainer(LinearRecipe(IdData(47, 0)), dp_args(
        tmp_path, epochs=1, dp={"noise_multiplier": 1.0, "accountant": "prv"})).train()
    expected = accountant_epsilon([(1.0, 10 / 47, 5)], cls=PRVAccountant)
    assert summary["privacy"]["epsilon"] == expected


def test_max_epsilon_is_found_once_not_asked_every_step(tmp_path, monkeypatch):
    """The run stops at the same step as before, but the accountant is asked a bounded
    number of times (the binary search), not once or twice per step."""
    from sailfin.backends import privacy_budget

    calls = []
    real = privacy_budget.epsilon_of
    monkeypatch.setattr(privacy_budget, "epsilon_of",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    limit = accountant_epsilon([(1.1, 10 / 47, 40)]) + 1e-9
    summary = Trainer(LinearRecipe(IdData(47, 0)), dp_args(
        tmp_path, epochs=20, dp={"noise_multiplier": 1.1, "max_epsilon": limit})).train()
    assert summary["global_step"] == 40
    assert summary["stopped_early"]["reason"] == "max_epsilon"
    assert summary["stopped_early"]["next_step_epsilon"] > limit >= summary["privacy"]["epsilon"]
    assert len(calls) < 10, len(calls)  # 40 steps, each logged: the table answers
    assert not math.isnan(summary["privacy"]["epsilon"])


def test_memory_snapshots_change_nothing_and_resume_the_same_noise_and_epsilon(tmp_path):
    """sp-dp with a budget: a run crashed after step 7 resumes from its snapshot in RAM
    (step 7, no checkpoint on disk) and ends as the run without snapshots."""
    ref, ref_summary = run(tmp_path / "ref", epochs=3, dp=TARGET)
    memory = {"at_epoch_end": False, "memory": {"every_n_steps": 1, "dir": str(tmp_path / "shm")}}

    def snapshotted(**kw):
        module = LinearRecipe(IdData(47, 0))
        trainer = Trainer(module, dp_args(tmp_path / "run", epochs=3, checkpoint=memory,
                                          dp=TARGET), **kw)
        return module, trainer.train()

    with pytest.raises(Crash):
        snapshotted(callbacks=[Settle(), CrashAt(7)])
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").glob("step-*"))
    module, summary = snapshotted(callbacks=[Settle()])
    assert summary["privacy"] == ref_summary["privacy"]
    for a, b in zip(ref.parameters(), module.parameters()):
        assert a.equal(b)
