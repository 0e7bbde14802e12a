"""Backends compared on the same recipe: precision x compilation, and activation checkpointing.

Workloads: the char_lm example (a 4-layer byte-level GPT, context 128, batch 16)
and the digits MLP (batch 64). For each, four trainers run the same recipe
from the same seed: fp32 eager (``sp``), bf16 eager (``sp-amp``), fp32 compiled
and bf16 compiled (``trainer.compile: true``). Each first runs a few warm-up
steps (for the compiled ones that is where compilation happens: its time is
reported on its own), then the four take turns, ``--rounds`` times, in an
order that reverses every round (A B C D, D C B A, ...) so machine noise hits
all alike. Every clock is the trainer's own loop time (``train_seconds``: set-up
excluded, the same for every config). Figures are medians over rounds of the
per-round ratio against fp32 eager in the same round. The line "compile pays ..." says after how many steps the
compile time is won back, or that it is not. Compilation starts from an empty
inductor cache (``--warm-cache`` keeps yours), so its time is a first run's.

Memory: at a long context (``--long-context``, default 512) the char_lm step
runs with and without ``activation_checkpointing: [Block]``; the bytes of
activations saved for backward are counted (and peak CUDA memory on a GPU),
with the step-time cost of recomputation.

    python benchmarks/backends.py [--rounds 5] [--threads 1] [--workloads char_lm,digits]
    python benchmarks/backends.py --device cuda --workloads char_lm_gpt2,char_lm
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import add_load_options, start, summary  # noqa: E402

from sailfin import Trainer, TrainerArguments  # noqa: E402
from sailfin.backends.checkpointing import apply_activation_checkpointing  # noqa: E402

CONFIGS = {  # name -> trainer keys
    "fp32 eager": dict(backend="sp"),
    "bf16 eager": dict(backend="sp-amp", amp_dtype="bfloat16"),
    # compile_check off: its eager window would be timed as compiled steps here
    "fp32 compiled": dict(backend="sp", compile=True, compile_check=False),
    "bf16 compiled": dict(backend="sp-amp", amp_dtype="bfloat16", compile=True,
                          compile_check=False),
}


# -- workloads -----------------------------------------------------------------------------
def char_lm(context: int = 128):
    from examples.char_lm.recipe import CharLM, StdlibText

    data = StdlibText(context=context, max_bytes=2_000_000, stride=64)
    return (lambda: CharLM(data, context=context, layers=4, dim=128, heads=4)), 16


def char_lm_gpt2():
    """The char_lm recipe at GPT-2 small's shape (12 layers, width 768, context 512): a
    workload a GPU is busy with, where ``char_lm`` is launch-bound."""
    from examples.char_lm.recipe import CharLM, StdlibText

    data = StdlibText(context=512, max_bytes=2_000_000, stride=64)
    return (lambda: CharLM(data, context=512, layers=12, dim=768, heads=12)), 16


def digits():
    from examples.digits.recipe import DigitsClassifier, DigitsData

    data = DigitsData()
    return (lambda: DigitsClassifier(data, hidden=128, dropout=0.0)), 64  # no dropout: losses comparable


WORKLOADS: dict[str, tuple[Callable[[], Any], int, int]] = {
    # name -> (workload, steps per round, warm-up steps)
    "char_lm": (char_lm, 8, 3),
    "char_lm_gpt2": (char_lm_gpt2, 20, 3),
    "digits": (digits, 500, 20),
}


# -- one trainer per config, run a few steps at a time ---------------------------------
class Runner:
    def __init__(self, make_module: Callable[[], Any], batch: int, keys: dict, out: str,
                 device: str):
        torch.manual_seed(0)
        self.module = make_module()
        self.device = torch.device(device)
        args = TrainerArguments(epochs=10**6, max_steps=1, train_batch_size=batch,
                                drop_last=True, val_every_n_epochs=0, log_every_n_steps=50,
                                output_dir=out, device=device, seed=0, **keys)
        self.trainer = Trainer(self.module, args, writers=[])

    def run(self, steps: int) -> float:
        """Train ``steps`` more steps; return the seconds the loop took."""
        t = self.trainer
        before = t.train_seconds
        t.args.max_steps = t.global_step + steps
        with contextlib.redirect_stdout(io.StringIO()):
            t.train()
        # On a GPU the epoch's clock stops after the loss check at its end, which waits for
        # every kernel queued before it.
        return t.train_seconds - before

    def val_loss(self, batch: Any) -> float:
        self.module.eval()
        with torch.no_grad():
            out = self.module.val_step(0, batch, self.device)
        self.module.train()
        return out["loss"].float().mean().item()


def bench_workload(name: str, rounds: int, out_dir: str, compile_: bool, device: str
                   ) -> dict[str, list[float]]:
    """Print the workload's table; return config -> per-round ratios to fp32 eager."""
    make, steps, warmup = WORKLOADS[name]
    make_module, batch = make()
    configs = {k: v for k, v in CONFIGS.items() if compile_ or not v.get("compile")}
    runners = {k: Runner(make_module, batch, v, os.path.join(out_dir, name, k.replace(" ", "_")),
                         device) for k, v in configs.items()}
    first = {k: r.run(warmup) for k, r in runners.items()}  # compilation happens here
    rates: dict[str, list[float]] = {k: [] for k in runners}
    order = list(runners)
    for i in range(rounds):
        this_round = order if i % 2 == 0 else order[::-1]
        rates_now = {k: steps / runners[k].run(steps) for k in this_round}
        for k, rate in rates_now.items():
            rates[k].append(rate)

    def ratios(a: str, b: str) -> list[float]:  # a against b, round by round
        return [x / y for x, y in zip(rates[a], rates[b])]

    val_batch = next(iter(runners["fp32 eager"].trainer.train_loader))
    total = warmup + rounds * steps
    print(f"\n## {name}: batch {batch}, {rounds} rounds x {steps} steps after {warmup} warm-up "
          f"steps, on {device}, {torch.get_num_threads()} thread(s)\n")
    print("| config | steps/s (median) | vs fp32 eager (median [min, max]) | "
          f"first {warmup} steps | loss after {total} steps |")
    print("| --- | --- | --- | --- | --- |")
    for k in runners:
        r = ratios(k, "fp32 eager")
        print(f"| {k} | {statistics.median(rates[k]):.2f} | {statistics.median(r):.3f} "
              f"[{min(r):.3f}, {max(r):.3f}] | {first[k]:.1f} s | "
              f"{runners[k].val_loss(val_batch):.4f} |")
    print()
    for precision in ("fp32", "bf16"):
        eager, compiled = f"{precision} eager", f"{precision} compiled"
        if compiled not in runners:
            continue
        r = ratios(compiled, eager)
        speedup = statistics.median(r)
        eager_step = 1 / statistics.median(rates[eager])
        compile_s = max(0.0, first[compiled] - warmup * eager_step / speedup)
        spread = f"median of rounds; range {min(r):.2f}-{max(r):.2f}"
        if speedup <= 1.0:
            print(f"- {precision}: compile does NOT pay on {name}: compiled runs at "
                  f"{speedup:.2f}x eager ({spread}) after {compile_s:.0f} s of compilation")
        else:
            after = compile_s / (eager_step * (1 - 1 / speedup))  # steps to win it back
            print(f"- {precision}: compile pays on {name} after ~{after:,.0f} steps "
                  f"(~{after * eager_step / 60:.1f} min of eager training): compiled runs at "
                  f"{speedup:.2f}x eager ({spread}) after {compile_s:.0f} s of compilation")
    return {k: ratios(k, "fp32 eager") for k in runners}


# -- activation checkpointing: memory and time at a long context ---------------------------
def saved_activation_bytes(module, batch, device: torch.device) -> int:
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = module.train_step(0, batch, device)
    loss.backward()
    module.zero_grad(set_to_none=True)
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)  # weights are not activations


def bench_checkpointing(context: int, rounds: int, device: torch.device) -> None:
    from examples.char_lm.recipe import CharLM

    batch_size = 8
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (batch_size, context + 1), generator=g)
    batch = (data[:, :-1], data[:, 1:])
    modules = {}
    for ckpt in (False, True):
        torch.manual_seed(0)
        modules[ckpt] = CharLM(None, context=context, layers=4, dim=128, heads=4).to(device)
        if ckpt:
            apply_activation_checkpointing(modules[ckpt], ["Block"])
    saved = {k: saved_activation_bytes(m, batch, device) for k, m in modules.items()}
    times: dict[bool, list[float]] = {False: [], True: []}
    peak: dict[bool, int] = {False: 0, True: 0}
    on_cuda = device.type == "cuda"
    for i in range(rounds):
        for ckpt in ((False, True) if i % 2 == 0 else (True, False)):
            m = modules[ckpt]
            if on_cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            start = time.perf_counter()
            m.train_step(0, batch, device).backward()
            if on_cuda:
                torch.cuda.synchronize()
                peak[ckpt] = torch.cuda.max_memory_allocated() - base
            times[ckpt].append(time.perf_counter() - start)
            m.zero_grad(set_to_none=True)
    ratio = statistics.median(t1 / t0 for t0, t1 in zip(times[False], times[True]))
    print(f"\n## activation checkpointing: char_lm, context {context}, batch {batch_size}, "
          f"{rounds} interleaved steps each, on {device}\n")
    print("| config | activations saved for backward | step time (median) |"
          + (" peak CUDA memory above the weights |" if on_cuda else ""))
    print("| --- | --- | --- |" + (" --- |" if on_cuda else ""))
    for ckpt, label in ((False, "plain"), (True, "activation_checkpointing: [Block]")):
        print(f"| {label} | {saved[ckpt] / 2**20:.1f} MiB | "
              f"{statistics.median(times[ckpt]) * 1000:.1f} ms |"
              + (f" {peak[ckpt] / 2**20:.1f} MiB |" if on_cuda else ""))
    print(f"\ncheckpointing keeps {saved[True] / saved[False]:.2f}x the activations for "
          f"{ratio:.2f}x the step time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1 keeps the timing steadier)")
    parser.add_argument("--workloads", default="char_lm,digits",
                        help=f"from {', '.join(WORKLOADS)}")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled configs")
    parser.add_argument("--long-context", type=int, default=512)
    parser.add_argument("--warm-cache", action="store_true",
                        help="keep inductor's on-disk cache (default: a fresh one, so the "
                             "compile time is what a first run pays)")
    add_load_options(parser)
    opts = parser.parse_args()
    load = start(opts, "backends.py")
    cache = None if opts.warm_cache else tempfile.TemporaryDirectory()
    if cache is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache.name
    torch.set_num_threads(opts.threads)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    device = torch.device(opts.device)
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}")
    print(f"torch {torch.__version__}; {os.cpu_count()} CPUs; inductor cache: "
          f"{'warm (kept)' if opts.warm_cache else 'cold (fresh directory)'}")
    with tempfile.TemporaryDirectory() as out:
        for name in opts.workloads.split(","):
            if name not in WORKLOADS:
                parser.error(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
            found = bench_workload(name, opts.rounds, out, not opts.no_compile, opts.device)
            rest = "; ".join(f"{k} {statistics.median(v):.3f}" for k, v in found.items()
                             if k not in ("fp32 eager", "bf16 eager"))
            summary("backends.py", f"{name} bf16 eager / fp32 eager steps/s (per-round)",
                    found["bf16 eager"], load, opts.threads, extra=rest)
    if opts.long_context:
        bench_checkpointing(opts.long_context, max(3, opts.rounds), device)
    if cache is not None:
        cache.cleanup()


if __name__ == "__main__":
    main()
