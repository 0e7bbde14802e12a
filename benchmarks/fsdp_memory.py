"""fsdp vs ddp at world size 2 on CPU: memory each rank holds, step time, checkpoints.

A GPT-style transformer of about 50 M parameters (12 blocks of width 512, an
untied 10k-token head) trains a few AdamW steps under ``ddp`` and under
``fsdp`` (each block a unit), 2 processes x 1 thread, gloo on loopback. Per
rank it reports:

* bytes of parameters + gradients + optimizer state the rank holds (each
  DTensor counted by its local shard), and the process's peak RSS;
* the median time of an optimizer step (after a warm-up step);
* the training stall per checkpoint save (``stall_seconds`` of the trainer's
  checkpoint callback), synchronous and with ``async_save``: sharded DCP
  under fsdp, sailfin's torch.save files under ddp;
* the time to resume from the last checkpoint (``trainer.resume: auto``).

Figures depend on the machine and its load: print ``/proc/loadavg`` beside them.

``--part memory`` (the default part) compares per-rank memory where the model is
big enough for its parameters to dominate (8 blocks of width 1024 and a 10k
head: about 120 M parameters, AdamW), ``ddp`` against ``fsdp`` with each
``trainer.fsdp.accumulate`` mode (2 micro-batches a step), fsdp built as ``sailfin train``
builds it (``sailfin.sharded_build``: rank 0 builds the model, the others on the meta
device and receive their rows):

* peak RSS of rank 0 and of rank 1 over their RSS before the model was built
  (high-water mark, the whole run), each against ddp's per-rank peak; rank 0 builds
  the whole model once in host memory, rank 1 only ever holds its rows and one
  tensor in flight;
* the peak of the build alone, and the build time (model constructed, trainer set
  up: sharded and every rank's rows filled) against sp's build of the same model;
* bytes of parameters + gradients + optimizer state held after the first step;
* the median step time after the first step.

It then trains the same model under a per-process memory budget, enforced by a
watchdog thread in each rank that reads the rank's RSS (``/proc/self/statm``)
every 2 ms and ends the process (exit 137, as the kernel's OOM killer would) once
the RSS passes the budget over its pre-build RSS (default 4.5 x the parameter
bytes): ``ddp`` cannot take its first step, ``fsdp`` trains (``--part budget``
runs only this).

    python benchmarks/fsdp_memory.py [--part memory|budget|checkpoints|all] [--steps 6]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sailfin.trainer.compose.setup as trainer_module  # noqa: E402 (resume is called there)
from sailfin import Callback, Trainer, TrainerArguments  # noqa: E402
from sailfin.config.distributed import DistArguments  # noqa: E402
from sailfin.utils.memory import peak_rss_bytes  # noqa: E402

from _fsdp_model import GPT, StepClock, Tokens, local_bytes  # noqa: E402


def _rank(rank: int, ports: tuple[int, int], opts, backend: str, async_save: bool, out: str,
          queue) -> None:
    def args(port: int, **kw) -> TrainerArguments:
        dist_args = DistArguments(launcher="manual", rank=rank, world_size=2,
                                  master_addr="127.0.0.1", master_port=port,
                                  threads_per_process=1, timeout_seconds=600)
        return TrainerArguments(
            epochs=1, train_batch_size=4, micro_batch_size=2, max_steps=opts.steps,
            output_dir=out, writers=[], val_every_n_epochs=0, progress="none",
            backend=backend, distributed=dist_args, fsdp={"units": ["Block"]},
            checkpoint={"every_n_steps": opts.save_every, "at_epoch_end": False,
                        "keep_last": 1, "async_save": async_save}, **kw)

    clock = StepClock()
    module = GPT(Tokens(4 * opts.steps), opts.layers, opts.width)
    n_params = sum(p.numel() for p in module.parameters())
    with Trainer(module, args(ports[0], resume="never"), callbacks=[clock]) as trainer:
        trainer.train()
        held = {"params": sum(local_bytes(p) for p in module.parameters()),
                "grads": module.grad_bytes,
                "optimizer": sum(local_bytes(v) for opt in trainer.optimizers
                                 for s in opt.state.values() for v in s.values()
                                 if isinstance(v, torch.Tensor) and v.dim() > 0)}
        saver = next(c for c in trainer.callbacks if hasattr(c, "stall_seconds"))
        stalls = list(saver.stall_seconds)
    rss = peak_rss_bytes()
    # Resume: a new trainer of the same run picks up the last checkpoint.
    timed: list[float] = []
    original = trainer_module.resume

    def timed_resume(trainer, checkpointer):
        started = time.perf_counter()
        try:
            return original(trainer, checkpointer)
        finally:
            timed.append(time.perf_counter() - started)

    trainer_module.resume = timed_resume
    try:
        again = GPT(Tokens(4 * opts.steps), opts.layers, opts.width)
        with Trainer(again, args(ports[1], resume="auto")) as trainer:
            trainer.setup()
    finally:
        trainer_module.resume = original
    queue.put((rank, {"n_params": n_params, "held": held, "rss": rss, "stalls": stalls,
                      "step": statistics.median(clock.times[1:] or clock.times),
                      "resume": timed[0]}))


def run(opts, backend: str, async_save: bool) -> list[dict]:
    ports = []
    for _ in range(2):  # the resuming trainer forms a new group: a port of its own
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as out:
        procs = [ctx.Process(target=_rank, args=(r, tuple(ports), opts, backend, async_save, out, queue))
                 for r in range(2)]
        for p in procs:
            p.start()
        try:
            results = dict(queue.get(timeout=opts.timeout) for _ in procs)
        finally:
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()
    return [results[0], results[1]]


# -- --part memory --------------------------------------------------------------------
def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def _watchdog(limit: int, stop: list) -> None:
    """End this process once its RSS passes ``limit`` bytes (the per-process budget)."""
    import threading

    def watch() -> None:
        while not stop:
            if _rss() > limit:
                os._exit(137)
            time.sleep(0.002)

    threading.Thread(target=watch, daemon=True).start()


def _memory_rank(out: str, rank: int, port: int, opts, backend: str, accumulate: str,
                 budget: float, queue) -> None:
    import contextlib

    from sailfin import sharded_build

    stop: list = []
    before = _rss()
    if budget:
        _watchdog(before + int(budget), stop)
    clock = StepClock()
    data = Tokens(8 * opts.steps)
    started = time.perf_counter()
    with sharded_build(rank) if backend == "fsdp" else contextlib.nullcontext():
        module = GPT(data, opts.mem_layers, opts.mem_width)
    held: dict = {}

    class Held(Callback):
        def on_step_end(self, trainer) -> None:
            if trainer.global_step == 1:  # the optimizer state exists from step 1 on
                held.update(params=sum(local_bytes(p) for p in module.parameters()),
                            grads=module.grad_bytes,
                            optimizer=sum(local_bytes(v) for opt in trainer.optimizers
                                          for st in opt.state.values() for v in st.values()
                                          if isinstance(v, torch.Tensor) and v.dim() > 0))
            if trainer.global_step == opts.steps:  # training's peak, before the final save
                held["train_peak"] = peak_rss_bytes()

    dist_args = DistArguments(launcher="manual", rank=rank, world_size=2,
                              master_addr="127.0.0.1", master_port=port,
                              threads_per_process=1, timeout_seconds=600)
    # out: one directory for both ranks (sharded checkpoints need shared storage)
    targs = TrainerArguments(
        epochs=1, train_batch_size=8, micro_batch_size=2, max_steps=opts.steps,
        output_dir=out, writers=[], val_every_n_epochs=0, progress="none",
        backend=backend, distributed=dist_args,
        fsdp={"units": ["Block"], "accumulate": accumulate})
    with Trainer(module, targs, callbacks=[clock, Held()]) as trainer:
        trainer.setup()  # the build ends here: sharded, every rank's rows filled
        build_seconds = time.perf_counter() - started
        build_peak = peak_rss_bytes() - before
        trainer.train()
    stop.append(True)
    end = peak_rss_bytes() - before
    peak = held.pop("train_peak") - before
    queue.put((rank, {"n_params": sum(p.numel() for p in module.parameters()),
                      "peak": peak, "end_peak": end, "held": held,
                      "build": build_seconds, "build_peak": build_peak,
                      "step": statistics.median(clock.times[1:] or clock.times)}))


def run_memory(opts, backend: str, accumulate: str = "full", budget: float = 0.0):
    """Per-rank results, or the exit codes when a rank was ended (over the budget)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    shared = tempfile.mkdtemp(prefix="sailfin-fsdp-memory-")  # both ranks write here
    procs = [ctx.Process(target=_memory_rank,
                         args=(shared, r, port, opts, backend, accumulate, budget, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    results: dict = {}
    deadline = time.monotonic() + opts.timeout
    try:
        while len(results) < 2 and time.monotonic() < deadline:
            try:
                rank, value = queue.get(timeout=1.0)
                results[rank] = value
            except Exception:  # queue.Empty: is a rank gone?
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
    finally:
        for p in procs:
            p.join(5 if len(results) == 2 else 0.1)
            if p.is_alive():
                p.kill()
                p.join(10)
        shutil.rmtree(shared, ignore_errors=True)
    if len(results) < 2:
        return [p.exitcode for p in procs]
    return [results[0], results[1]]


def _sp_build(opts, queue) -> None:
    """The time ``sp`` takes to build the same model and set the trainer up (one process)."""
    data = Tokens(8 * opts.steps)
    started = time.perf_counter()
    module = GPT(data, opts.mem_layers, opts.mem_width)
    targs = TrainerArguments(epochs=1, train_batch_size=8, micro_batch_size=2,
                             max_steps=opts.steps, output_dir=tempfile.mkdtemp(), writers=[],
                             val_every_n_epochs=0, progress="none", backend="sp")
    with Trainer(module, targs) as trainer:
        trainer.setup()
        queue.put(time.perf_counter() - started)
    shutil.rmtree(targs.output_dir, ignore_errors=True)


def sp_build_seconds(opts) -> float:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_sp_build, args=(opts, queue))
    proc.start()
    try:
        return queue.get(timeout=opts.timeout)
    finally:
        proc.join(60)


def memory_part(opts) -> None:
    mib = 1 << 20
    load = Path("/proc/loadavg").read_text().split()[:3]
    if opts.part == "budget":
        return budget_part(opts, mib)
    rows = {}
    for backend, accumulate in (("ddp", "full"), ("fsdp", "full"), ("fsdp", "sharded")):
        rows[backend, accumulate] = run_memory(opts, backend, accumulate)
        print(f"ran {backend} accumulate={accumulate}", flush=True)
    n = rows["ddp", "full"][0]["n_params"]
    print(f"\nmodel: {n / 1e6:.1f} M parameters ({n * 4 / mib:.0f} MiB), AdamW; world 2 x 1 "
          f"thread (gloo, CPU); 2 micro-batches a step; load average at start "
          f"{' '.join(load)}, at end {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    sp_build = sp_build_seconds(opts)
    print("peak RSS over the RSS before the build, per rank: the whole run (build, training, "
          "final save), and the build alone; build: the model constructed and the trainer "
          f"set up (sp: {sp_build:.2f} s)")
    print("| backend | accumulate | rank 0 peak (MiB) | rank 1 peak (MiB) | build peak r0 / r1 "
          "(MiB) | build (s) | held after step 1 (MiB) | step (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    ddp_peak = max(max(r["peak"], r["end_peak"]) for r in rows["ddp", "full"])
    for (backend, accumulate), ranks in rows.items():
        peaks = [max(r["peak"], r["end_peak"]) for r in ranks]
        held = max(sum(r["held"].values()) for r in ranks)
        build = max(r["build"] for r in ranks)
        print(f"| {backend} | {accumulate if backend == 'fsdp' else '-'} | "
              f"{peaks[0] / mib:.0f} ({peaks[0] / ddp_peak:.2f} x ddp) | "
              f"{peaks[1] / mib:.0f} ({peaks[1] / ddp_peak:.2f} x ddp) | "
              f"{ranks[0]['build_peak'] / mib:.0f} / {ranks[1]['build_peak'] / mib:.0f} | "
              f"{build:.2f} ({build / sp_build:.2f} x sp) | {held / mib:.0f} | "
              f"{max(r['step'] for r in ranks):.2f} |")
    budget_part(opts, mib, n)


def budget_part(opts, mib: int, n: int = 0) -> None:
    n = n or 121_300_000
    budget = opts.budget_mib * mib if opts.budget_mib else 4.5 * n * 4
    print(f"\nbudget: {budget / mib:.0f} MiB per process over its pre-build RSS (an RSS "
          "watchdog thread ends a rank that passes it, exit 137)")
    for backend, accumulate in (("ddp", "full"), ("fsdp", "sharded")):
        got = run_memory(opts, backend, accumulate, budget)
        if isinstance(got[0], dict):
            print(f"  {backend}: trained {opts.steps} steps; peak "
                  f"{max(r['peak'] for r in got) / mib:.0f} MiB")
        else:
            print(f"  {backend}: ended over the budget (exit codes {got})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--part", choices=("memory", "budget", "checkpoints", "all"),
                        default="memory")
    parser.add_argument("--mem-layers", type=int, default=8)
    parser.add_argument("--mem-width", type=int, default=1024)
    parser.add_argument("--budget-mib", type=float, default=0.0,
                        help="per-process budget (default: 4.5 x the parameter bytes)")
    opts = parser.parse_args()
    if opts.part in ("memory", "budget", "all"):
        memory_part(opts)
    if opts.part in ("memory", "budget"):
        return
    mib = 1 << 20
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    results = {}
    for backend in ("ddp", "fsdp"):
        for async_save in (False, True):
            results[backend, async_save] = run(opts, backend, async_save)
            print(f"ran {backend} async_save={async_save}", flush=True)
    n = results["ddp", False][0]["n_params"]
    print(f"\nmodel: {n / 1e6:.1f} M parameters, AdamW; world size 2 x 1 thread (gloo, CPU); "
          f"{opts.steps} steps, a save every {opts.save_every}; load average at start "
          f"{' '.join(load)}, at end {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    held = {}
    for backend in ("ddp", "fsdp"):
        ranks = results[backend, False]
        per = [sum(r["held"].values()) for r in ranks]
        held[backend] = max(per)
        parts = ", ".join(f"{k} {max(r['held'][k] for r in ranks) / mib:.0f}"
                          for k in ("params", "grads", "optimizer"))
        print(f"{backend:>5}: per rank {held[backend] / mib:7.1f} MiB held ({parts} MiB); "
              f"peak RSS {max(r['rss'] for r in ranks) / mib:.0f} MiB; step "
              f"{max(r['step'] for r in ranks):.2f} s")
    ddp_step = max(r["step"] for r in results["ddp", False])
    fsdp_step = max(r["step"] for r in results["fsdp", False])
    print(f"fsdp / ddp: held per rank {held['fsdp'] / held['ddp']:.2f} x (target <= 0.55), "
          f"step time {fsdp_step / ddp_step:.2f} x")
    for backend, form in (("ddp", "torch.save files, rank 0"), ("fsdp", "DCP shards, every rank")):
        stall = {a: statistics.median(s for r in results[backend, a] for s in r["stalls"])
                 for a in (False, True)}
        resume = max(r["resume"] for r in results[backend, False])
        print(f"{backend:>5} checkpoint ({form}): stall per save sync {stall[False]:.2f} s, "
              f"async {stall[True]:.2f} s; resume {resume:.2f} s")


if __name__ == "__main__":
    main()
