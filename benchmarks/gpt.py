"""A GPT-2-small-shaped model on one GPU: sailfin against the loop a GPU user writes by hand.

The model is a nanoGPT-style decoder written here (12 layers, width 768, 12 heads,
context 1024, a 50,304-token vocabulary, the embedding tied to the output head,
attention through ``scaled_dot_product_attention`` so that flash attention runs
on a GPU), trained on generated tokens in bf16 autocast with fused AdamW (lr 6e-4,
betas 0.9/0.95, weight decay 0.1 on the matrices), micro-batch 16, accumulation 4
(64 sequences, 65,536 tokens a step) and gradients clipped at 1.0.

Arms, each holding its own copy of the model, all starting from the same weights
and reading the same batches in the same order (sailfin's sampler; the others read
them through the same ``DataLoader`` over the same tensors):

- ``hand``: the loop nanoGPT's ``train.py`` runs (loss / accumulation, backward per
  micro-batch, clip, step, ``zero_grad(set_to_none=True)``, ``loss.item()`` only when
  logging);
- ``sailfin``: ``backend: sp-amp``, ``amp_dtype: bfloat16``, the same recipe;
- ``sailfin fsdp``: ``backend: fsdp`` on one GPU (bf16 parameters in compute,
  fp32 reductions; blocks as units);
- ``fabric`` / ``accelerate``: Lightning Fabric (``bf16-mixed``) and Accelerate
  (``mixed_precision="bf16"``) around the same loop, where they are installed;
- ``hand compiled`` / ``sailfin compiled``: ``torch.compile`` on the model
  (sailfin: ``trainer.compile: true``).

Every arm first runs ``--warmup`` steps (compilation happens there; its time is
printed), then the arms take turns, ``--rounds`` times, ``--steps`` steps each, in an
order that reverses every round; each arm's clock stops after the GPU has finished
its queued work. Printed: tokens/s (median of rounds), each arm over the hand loop
in the same round (median and range), MFU against the device's bf16 dense peak
(FLOPs per token 6 N + 12 L d T, N the parameters less the position embedding, as
in the PaLM paper's appendix), the arm's peak GPU memory above what was allocated
before it was built, and how far its weights ended from the hand loop's (``equal``: bit for
bit; on a GPU two runs of the hand loop differ too, since the embedding's backward adds
with atomics).

``--snapshots``: sailfin alone, without memory snapshots and with one every step
and every 10 steps: step time over the run without, and the milliseconds the step
waited per snapshot (``MemorySnapshots.stall_seconds``). ``--async-save``: a disk
checkpoint every 50 steps with ``async_save: true``, the stall per save
(``CheckpointCallback.stall_seconds``) against the step time.

    python benchmarks/gpt.py                      # on a GPU: every arm, 3 rounds
    python benchmarks/gpt.py --snapshots --async-save
    python benchmarks/gpt.py --tiny --device cpu  # the same code on a CPU (the test suite)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _gpt_arms import Accelerate, Fabric, Hand, Sailfin, synchronize  # noqa: E402
from _gpt_model import (GPT2, TINY, Shape, flops_per_token, make_gpt,  # noqa: E402
                        make_gpt_meta, tokens)
from _measure import add_load_options, start, summary  # noqa: E402

from sailfin import Callback  # noqa: E402


# bf16 dense peak (TFLOP/s) by device name, NVIDIA's data-sheet figures; --peak-tflops overrides
PEAKS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("H200", 989.4),
         ("H20", 148.0), ("A100", 312.0), ("L40S", 362.0), ("A10G", 70.0))


def installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def weight_gap(a: nn.Module, b: nn.Module) -> str:
    """``equal`` (bit for bit), or the largest absolute difference of any weight. On a GPU
    two runs of the same loop differ too: the embedding's backward adds with atomics."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    gap = max(float((sa[k].float().cpu() - sb[k].float().cpu()).abs().max()) for k in sa)
    return "equal" if gap == 0 else f"max diff {gap:.1e}"


def full_weights(arm: Any) -> nn.Module:
    """The arm's model with whole tensors (sailfin fsdp: gathered from its shards)."""
    model = arm.weights()
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict)

        full = make_gpt(model.shape)
        full.load_state_dict(get_model_state_dict(model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True)))
        return full
    return model


# -- the comparison ----------------------------------------------------------------------------
def peak_tflops(device: torch.device, given: Optional[float]) -> tuple[Optional[float], str]:
    if given:
        return given, f"{given:g} TFLOP/s (--peak-tflops)"
    if device.type != "cuda":
        return None, "no peak figure on a CPU (MFU not printed)"
    name = torch.cuda.get_device_name(device)
    for key, value in PEAKS:
        if key in name:
            return value, f"{value:g} TFLOP/s, NVIDIA's bf16 dense figure for {key}"
    return None, f"no bf16 peak known for {name}; pass --peak-tflops"


def measured(make: Callable[[], Any], warmup: int, device: torch.device) -> tuple[Any, float, int]:
    """Build an arm and run its warm-up steps: (arm, warm-up seconds, peak memory bytes
    above what was allocated before it was built; 0 on a CPU)."""
    cuda = device.type == "cuda"
    if cuda:
        synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    begin = time.perf_counter()
    arm = make()
    arm.run(warmup)
    seconds = time.perf_counter() - begin
    peak = torch.cuda.max_memory_allocated(device) - base if cuda else 0
    return arm, seconds, peak


def rounds_of(arms: dict[str, Any], rounds: int, steps: int) -> dict[str, list[float]]:
    """Seconds per step of every arm, per round, in an order reversed every round."""
    per_step: dict[str, list[float]] = {k: [] for k in arms}
    names = list(arms)
    for i in range(rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            per_step[name].append(arms[name].run(steps) / steps)
    return per_step


def compare(s: Shape, opts: argparse.Namespace, device: torch.device, out: str,
            load: Any) -> None:
    total = opts.warmup + opts.rounds * opts.steps
    ds = tokens(s, total * s.micro * s.accumulation)
    makers: dict[str, Callable[[], Any]] = {
        "hand": lambda: Hand(s, ds, device),
        "sailfin": lambda: Sailfin(s, ds, device, os.path.join(out, "sp"), backend="sp-amp",
                                   amp_dtype="bfloat16"),
        "sailfin fsdp": lambda: Sailfin(s, ds, device, os.path.join(out, "fsdp"), backend="fsdp-amp",
                                        amp_dtype="bfloat16", fsdp={"units": ["Block"]}),
    }
    if installed("lightning"):
        makers["fabric"] = lambda: Fabric(s, ds, device)
    if installed("accelerate"):
        makers["accelerate"] = lambda: Accelerate(s, ds, device)
    if not opts.no_compile:
        makers["hand compiled"] = lambda: Hand(s, ds, device, compiled=True)
        makers["sailfin compiled"] = lambda: Sailfin(
            s, ds, device, os.path.join(out, "spc"), backend="sp-amp", amp_dtype="bfloat16",
            compile=True, compile_check=False)
    skipped = [k for k in opts.skip.split(",") if k and k != "hand"]  # the reference stays
    makers = {k: v for k, v in makers.items() if k not in skipped}
    arms, first, peak = {}, {}, {}
    for name, make in makers.items():
        try:
            arms[name], first[name], peak[name] = measured(make, opts.warmup, device)
        except Exception as exc:  # a peer that does not run here is reported, not fatal
            print(f"{name}: could not run ({type(exc).__name__}: {exc})".splitlines()[0],
                  flush=True)
    per_step = rounds_of(arms, opts.rounds, opts.steps)
    step_tokens = s.micro * s.accumulation * s.context
    peak_value, peak_said = peak_tflops(device, opts.peak_tflops)
    fpt = flops_per_token(s)
    hand_weights = full_weights(arms["hand"])
    print(f"\n## {s.layers} layers, width {s.dim}, context {s.context}: {step_tokens:,} tokens "
          f"a step (micro-batch {s.micro} x {s.accumulation}), bf16 autocast, on "
          f"{describe(device)}; {opts.rounds} rounds x {opts.steps} steps after "
          f"{opts.warmup} warm-up steps; peak: {peak_said}\n")
    print("| arm | tokens/s | over the hand loop (median [min, max]) | MFU | peak memory | "
          f"first {opts.warmup} steps | weights vs the hand loop's |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    figures = {}
    for name in arms:
        reference = "hand compiled" if "compiled" in name and "hand compiled" in arms else "hand"
        ratio = [h / a for a, h in zip(per_step[name], per_step[reference])]
        rate = step_tokens / statistics.median(per_step[name])
        mfu = f"{rate * fpt / 1e12 / peak_value:.1%}" if peak_value else "n/a"
        same = weight_gap(full_weights(arms[name]), hand_weights)
        figures[name] = ratio
        print(f"| {name} | {rate:,.0f} | {statistics.median(ratio):.3f} [{min(ratio):.3f}, "
              f"{max(ratio):.3f}]{' (vs hand compiled)' if reference != 'hand' else ''} | "
              f"{mfu} | {peak[name] / 2**20:,.0f} MiB | {first[name]:.1f} s | {same} |",
              flush=True)
    extra = "; ".join(f"{k} {statistics.median(v):.3f}" for k, v in figures.items()
                      if k not in ("hand", "sailfin"))
    summary("gpt.py", "sailfin / hand loop tokens/s (sp-amp, eager)", figures["sailfin"], load,
            torch.get_num_threads(), extra=extra + "; goal >= 0.98")
    for arm in arms.values():
        if isinstance(arm, Sailfin):
            arm.trainer.close()  # fsdp: leaves its process group


class StepClock(Callback):
    """When each optimizer step ended (the clock the saving runs are timed by)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, trainer) -> None:
        self.ends.append(time.perf_counter())


def saving_run(s: Shape, ds, device: torch.device, out: str, steps: int, warmup: int,
               keys: dict) -> tuple[float, list[float]]:
    """One whole run of ``warmup + steps`` steps: (seconds per step after the warm-up, the
    seconds the step waited for each snapshot or save after the first)."""
    clock = StepClock()
    arm = Sailfin(s, ds, device, out, backend="sp-amp", amp_dtype="bfloat16",
                  checkpoint=dict(keys, at_epoch_end=False), callbacks=[clock])
    arm.run(warmup + steps)  # ends when the last write is done
    memory = bool(keys.get("memory"))
    saver = next((c for c in arm.trainer.callbacks if hasattr(c, "stall_seconds")
                  and hasattr(c, "copy_waits") == memory), None)
    stalls = list(saver.stall_seconds)[1:] if saver is not None else []  # the first: set-up
    per_step = (clock.ends[-1] - clock.ends[warmup - 1]) / steps
    arm.trainer.close()
    del arm
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return per_step, stalls


def snapshot_costs(s: Shape, opts: argparse.Namespace, device: torch.device, out: str,
                   load: Any) -> None:
    """Memory snapshots (every step, every 10) and async saves against the same run
    without: whole runs, one after another, in an order reversed every round."""
    configs: dict[str, dict] = {"none": {}}
    if opts.snapshots:
        configs["snapshot every step"] = {"memory": {"every_n_steps": 1}}
        configs["snapshot every 10 steps"] = {"memory": {"every_n_steps": 10}}
    if opts.async_save:
        configs[f"async_save every {opts.async_every}"] = {
            "every_n_steps": opts.async_every, "async_save": True, "keep_last": 1}
    # steps timed per run: the async run sees two saves (the second at its last step)
    steps = {k: 2 * opts.async_every if k.startswith("async") else opts.save_steps
             for k in configs}
    warmup = max(2, opts.warmup)
    ds = tokens(s, (warmup + max(steps.values())) * s.micro * s.accumulation)
    per_step: dict[str, list[float]] = {k: [] for k in configs}
    stalls: dict[str, list[float]] = {k: [] for k in configs}
    names = list(configs)
    for i in range(opts.rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            run_dir = os.path.join(out, f"{name.replace(' ', '_')}-{i}")
            t, waited = saving_run(s, ds, device, run_dir, steps[name], warmup, configs[name])
            per_step[name].append(t)
            stalls[name] += waited
            print(f"round {i + 1}, {name}: {t * 1e3:.1f} ms a step" + (
                f"; waited {statistics.median(waited) * 1e3:.1f} ms (median of {len(waited)})"
                if waited else ""), flush=True)
    state = sum(p.numel() * p.element_size() for p in make_gpt_meta(s).parameters())
    print(f"\n## saving state while training: sailfin sp-amp, the same model and batches; "
          f"{opts.rounds} rounds of whole runs, {opts.save_steps} steps timed after {warmup} "
          f"(async_save: {2 * opts.async_every}); "
          f"parameters {state / 2**20:,.0f} MiB in fp32 (AdamW's state twice that)\n")
    print("| run | step time | over the run without (median [min, max]) | the step waited "
          "per snapshot or save (median, max) |")
    print("| --- | --- | --- | --- |")
    for name in configs:
        ratio = [a / b for a, b in zip(per_step[name], per_step["none"])]
        waited = stalls[name]
        waits = (f"{statistics.median(waited) * 1e3:.1f} ms, {max(waited) * 1e3:.1f} ms "
                 f"(n={len(waited)})") if waited else ""
        print(f"| {name} | {statistics.median(per_step[name]) * 1e3:.1f} ms | "
              f"{statistics.median(ratio):.3f} [{min(ratio):.3f}, {max(ratio):.3f}] | "
              f"{waits} |", flush=True)
    if opts.snapshots:
        summary("gpt.py", "step time, a memory snapshot every step / none",
                [a / b for a, b in zip(per_step["snapshot every step"], per_step["none"])],
                load, torch.get_num_threads(), extra="goal <= 1.05")


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"CPU ({os.cpu_count()} CPUs), torch {torch.__version__}"


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true",
                        help="2 layers, width 64, context 64 (the test suite's size)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="steps per arm per round")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the clock starts")
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled arms")
    parser.add_argument("--skip", default="", help="arms to leave out, comma-separated")
    parser.add_argument("--snapshots", action="store_true",
                        help="also: memory snapshots every step and every 10 steps")
    parser.add_argument("--async-save", action="store_true",
                        help="also: a disk checkpoint every --async-every steps, async_save")
    parser.add_argument("--async-every", type=int, default=50)
    parser.add_argument("--save-steps", type=int, default=30,
                        help="steps timed per saving run (the async_save run: 2 x --async-every)")
    parser.add_argument("--only-saves", action="store_true",
                        help="skip the arms' comparison (with --snapshots / --async-save)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's bf16 dense peak, for MFU (default: by device name)")
    add_load_options(parser)
    opts = parser.parse_args(argv)
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here (use --device cpu)")
    load = start(opts, "gpt.py")
    warnings.filterwarnings("ignore")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    s = TINY if opts.tiny else GPT2
    with tempfile.TemporaryDirectory() as out:
        if not opts.only_saves:
            compare(s, opts, device, out, load)
        if opts.snapshots or opts.async_save:
            snapshot_costs(s, opts, device, out, load)


if __name__ == "__main__":
    main()
