"""benchmarks/gpt.py at its tiny size on the CPU: every arm trains the same GPT on the same
batches (sailfin's weights end equal to the hand loop's, so the comparison is like for like),
and the saving runs report their step time and waits. The GPU figures come from the same code
(``make test-gpu``)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import gpt  # noqa: E402


def test_flops_per_token_counts_gpt2_small_as_the_palm_estimate_does():
    n = 124_475_904 - 1024 * 768  # the 12 x 768 model's parameters (tied head), less wpe
    assert gpt.flops_per_token(gpt.GPT2) == 6 * n + 12 * 12 * 768 * 1024
    assert sum(p.numel() for p in gpt.make_gpt_meta(gpt.GPT2).parameters()) == 124_475_904


def test_the_peak_comes_from_the_device_name_or_the_option(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert gpt.peak_tflops(torch.device("cuda"), None)[0] == 756.0
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert gpt.peak_tflops(torch.device("cuda"), None)[0] == 989.4
    assert gpt.peak_tflops(torch.device("cuda"), 500.0)[0] == 500.0
    assert gpt.peak_tflops(torch.device("cpu"), None)[0] is None


@pytest.mark.slow
def test_every_arm_and_saving_run_reports_and_sailfin_trains_what_the_hand_loop_trains(capsys):
    gpt.main(["--tiny", "--device", "cpu", "--allow-load", "--rounds", "2", "--steps", "2",
              "--warmup", "1", "--no-compile", "--snapshots", "--async-save", "--async-every",
              "2", "--save-steps", "4"])
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| ") and "---" not in line}
    assert rows["hand"][1].startswith("1.000")
    assert rows["sailfin"][-1] == "equal"  # the same weights as the hand loop, bit for bit
    assert "sailfin fsdp" in rows
    for name in ("snapshot every step", "snapshot every 10 steps", "async_save every 2"):
        assert float(rows[name][0].split()[0]) > 0  # its step time, in ms
    assert " ms (n=" in rows["snapshot every step"][2]  # the waits were recorded
    assert " ms (n=" in rows["async_save every 2"][2]
    assert out.count("SUMMARY gpt.py") == 2
