"""The benchmarks' shared harness: load refusal, interleaved order, per-round ratios."""

import argparse
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import _measure  # noqa: E402


def options(*argv):
    parser = argparse.ArgumentParser()
    _measure.add_load_options(parser)
    return parser.parse_args(list(argv))


def test_a_busy_machine_is_refused_unless_allowed(monkeypatch, capsys):
    monkeypatch.setattr(_measure, "loadavg", lambda: 3.0)
    with pytest.raises(SystemExit) as stop:
        _measure.start(options("--max-load", "1.5"), "bench.py")
    assert stop.value.code == 3 and "--allow-load" in capsys.readouterr().err
    load = _measure.start(options("--max-load", "1.5", "--allow-load"), "bench.py")
    line = _measure.summary("bench.py", "a / b", [1.0, 1.2, 0.9], load, 1)
    assert line.startswith("SUMMARY bench.py: a / b = median 1.000 (min 0.900, max 1.200, n=3)")
    assert "torch threads 1" in line and "load1 3.00 -> 3.00" in line and "LOADED" in line


def test_quiet_summary_and_interleaved_rounds(monkeypatch):
    monkeypatch.setattr(_measure, "loadavg", lambda: 0.2)
    calls = []
    rounds = _measure.interleave(2, {"a": lambda i: calls.append(("a", i)) or 2.0,
                                     "b": lambda i: calls.append(("b", i)) or 1.0})
    assert calls == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    assert rounds == [{"b": 1.0, "a": 2.0}, {"a": 2.0, "b": 1.0}]  # warm-up round dropped
    assert _measure.ratios(rounds, "a", "b") == [2.0, 2.0]
    line = _measure.summary("x.py", "a / b", [2.0], _measure.start(options(), "x.py"), 1)
    assert "LOADED" not in line and "load1 0.20 -> 0.20" in line


def test_the_machine_is_named_with_its_cpu_and_capability():
    torch = pytest.importorskip("torch")
    described = _measure.machine()
    assert _measure.cpu_model() in described
    assert f"capability {torch.backends.cpu.get_cpu_capability()}" in described
    assert f"torch {torch.__version__}" in described
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as fh:
            names = [line.split(":", 1)[1].strip() for line in fh
                     if line.split(":", 1)[0].strip() == "model name"]
        if names:
            assert _measure.cpu_model() == names[0]
