"""Memory snapshots every step, like for like: step time with a snapshot every step over
step time without, under sp and under 2-process ddp (gloo, one node); the milliseconds
each snapshot adds; and, in the same run, the time of one plain copy of the same state
on this machine, so that the cost reads against the memory bus.

Each round runs every arm once, in alternating order, each run in a process of its own
(so that ``--against REV`` can run a previous release's sailfin, from a ``git worktree``
of REV in a temporary directory, in the same rounds). A run's step time is its steady
state: from the end of its first step to the end of its last. The figure is the median
of the per-round ratios. Snapshots go to a directory in /dev/shm, as a run keeps them.
Two processes of the same arm can differ by more than a snapshot costs (on a small
shared machine up to 20 %): ``--blocks B`` also runs, each round, each release with
snapshots on and off in alternate blocks of B steps inside one run, and compares the
median step of each. It also prints the training thread's own time per snapshot (what
the snapshot callback records as holding training: its bookkeeping, the copy's set-up
and any wait for the copy), free of that spread. ``--device cuda``: GPT-2 small (124 M
parameters, AdamW) on one GPU, sp only; it also prints how long each step waited for
the snapshot's copy.

    python benchmarks/memory_snapshots.py [--rounds 5] [--steps 60] [--threads 1]
        [--against 562e3ce] [--device cuda] [--backends sp ddp] [--blocks 10]
    (benchmarks/checkpoint.py runs it too, unless --no-memory)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _measure import add_load_options, interleave, spread, start, summary  # noqa: E402

DIMS = [512, 1024, 1024, 512, 10]  # 2.1 M parameters: 8 MB, and 16 MB of AdamW state
BATCH = 64  # per process and step (cuda: 8 sequences of 1024 tokens)
STEPS = 60  # per run


def recipe(device: str, n: int):
    from sailfin import DataInterface, ModuleInterface

    class Data(DataInterface):
        def get_train_dataset(self):
            g = torch.Generator().manual_seed(0)
            if device == "cuda":
                return torch.utils.data.TensorDataset(torch.randint(0, 50257, (n, 1024),
                                                                    generator=g))
            return torch.utils.data.TensorDataset(torch.randn(n, DIMS[0], generator=g),
                                                  torch.randint(0, 10, (n,), generator=g))

    class Recipe(ModuleInterface):
        def __init__(self) -> None:
            super().__init__()
            self.data = Data()
            torch.manual_seed(0)
            if device == "cuda":
                from transformers import GPT2Config, GPT2LMHeadModel
                self.net = GPT2LMHeadModel(GPT2Config())
            else:
                layers: list[nn.Module] = []
                for a, b in zip(DIMS, DIMS[1:]):
                    layers += [nn.Linear(a, b), nn.ReLU()]
                self.net = nn.Sequential(*layers[:-1])

        def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
            return [torch.optim.AdamW(self.parameters(), lr=1e-4)], []

        def train_step(self, global_step, batch, device_):
            if device == "cuda":
                ids = batch[0].to(device_)
                return self.net(input_ids=ids, labels=ids).loss
            x, y = batch
            return nn.functional.cross_entropy(self.net(x.to(device_)), y.to(device_))

    return Recipe()


def plain_copy_seconds(state: dict) -> float:
    """One plain copy of ``state``'s tensors into buffers made before (on a GPU: into
    pinned host memory), the median of 10."""
    tensors = [t for t in _tensors(state)]
    targets = [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for t in tensors]
    times = []
    for _ in range(10):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        for d, s in zip(targets, tensors):
            d.copy_(s, non_blocking=s.is_cuda)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj.detach()
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def run(spec: dict, dist=None) -> dict:
    """One training run as ``spec`` says; its steady step time and what it measured."""
    from sailfin import Callback, Trainer, TrainerArguments
    from sailfin.config.distributed import DistArguments

    class Clock(Callback):
        marks: list = []

        def on_train_start(self, trainer) -> None:
            self.marks.append(time.perf_counter())

        def on_step_end(self, trainer) -> None:
            self.marks.append(time.perf_counter())

    world, steps, device = (2 if dist else 1), spec["steps"], spec["device"]
    # In the node's shared memory, as a run keeps them by default (not on a disk, whose
    # write-back of every snapshot would be a cost that no real run pays).
    shm = spec["shm"] if spec["memory"] else None
    args = TrainerArguments(
        epochs=1, train_batch_size=(8 if device == "cuda" else BATCH) * world,
        micro_batch_size=8 if device == "cuda" else BATCH, output_dir=spec["out"],
        writers=[], val_every_n_epochs=0, log_every_n_steps=10_000, resume="never",
        progress="none", backend="ddp" if dist is not None else "sp",
        distributed=dist or DistArguments(), device=device,
        checkpoint={"at_epoch_end": False, "memory": {"every_n_steps": spec["every"],
                                                      "dir": shm} if shm else {}})
    class Blocks(Callback):
        """Snapshots on (every step) in alternate blocks of ``blocks`` steps (same run:
        same process, same memory placement), by the snapshot callback's interval."""

        def on_step_end(self, trainer) -> None:
            on = (trainer.global_step // spec["blocks"]) % 2 == 0
            found = [c for c in trainer.callbacks
                     if hasattr(c, "stall_seconds") and isinstance(getattr(c, "every", None), int)]
            if not found:
                raise RuntimeError("--blocks: this sailfin's snapshot callback has no "
                                   "interval (every) to turn snapshots on and off by")
            for c in found:
                c.every = 1 if on else 10 ** 9

    clock = Clock()
    extra = [Blocks()] if spec.get("blocks") else []
    trainer = Trainer(recipe(device, steps * args.train_batch_size), args,
                      callbacks=[*extra, clock])
    trainer.setup()
    store = getattr(trainer.checkpointer, "store", None)
    if store is not None and hasattr(store, "start_writer"):  # the previous release's
        store.start_writer(wait=True)  # its start is not a step's cost
    trainer.train()
    snapshots = [c for c in trainer.callbacks if hasattr(c, "stall_seconds")]
    waits = (getattr(snapshots[0], "copy_waits", None) or getattr(snapshots[0], "write_waits", [])
             if snapshots else [])
    copy = plain_copy_seconds(trainer.state_dict()) if spec.get("copy") else None
    trainer.close()
    marks = clock.marks
    held = snapshots[0].stall_seconds[1:] if snapshots else []  # the first sets up
    result = {"step": (marks[-1] - marks[1]) / (steps - 1), "waits": len(waits),
              "waited": sum(waits), "copy": copy,
              "held": statistics.median(held) if held else None}
    if spec.get("blocks"):  # step k+1 follows step k's snapshot when k's block is on
        b, times = spec["blocks"], {True: [], False: []}
        for k, (t0, t1) in enumerate(zip(marks[1:], marks[2:]), start=1):
            if k >= 2 * b:  # the first on and off blocks warm up
                times[(k // b) % 2 == 0].append(t1 - t0)
        result.update(on=statistics.median(times[True]), off=statistics.median(times[False]))
    return result


def _rank(rank: int, port: int, spec: dict, queue) -> None:
    from sailfin.config.distributed import DistArguments

    torch.set_num_threads(spec["threads"])
    dist = DistArguments(launcher="manual", rank=rank, world_size=2, local_rank=rank,
                         local_world_size=2, master_addr="127.0.0.1", master_port=port,
                         threads_per_process=spec["threads"])
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        result = run(spec, dist)
    if rank == 0:
        queue.put(result)


def child(spec: dict) -> dict:
    """The run a round's arm asked for, in this process (and 2 ranks under ddp)."""
    torch.set_num_threads(spec["threads"])
    if not spec["ddp"]:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return run(spec)
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, spec, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=900)
    for p in procs:
        p.join(60)
    return result


def launch(spec: dict, sailfin_root: str) -> dict:
    """``child(spec)`` in a new process importing the sailfin of ``sailfin_root``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [sailfin_root, os.environ.get("PYTHONPATH")])), "OMP_NUM_THREADS":
        str(spec["threads"])}
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                           json.dumps(spec)], capture_output=True, text=True, env=env,
                          timeout=1800, cwd=sailfin_root)  # (a child's cwd is on its path)
    if done.returncode != 0:
        raise RuntimeError(f"a run failed ({sailfin_root}): {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def checkout(rev: str | None):
    """A ``git worktree`` of ``rev`` in a temporary directory (None: nothing)."""
    if rev is None:
        yield None
        return
    top = os.path.dirname(HERE)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "sailfin")
        subprocess.run(["git", "-C", top, "worktree", "add", "--detach", path, rev],
                       check=True, capture_output=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", top, "worktree", "remove", "--force", path],
                           capture_output=True)


def measure(rounds: int, steps: int, threads: int, load, every: int = 1,
            against: str | None = None, device: str = "cpu",
            only: tuple[str, ...] = ("sp", "ddp"), blocks: int = 0) -> None:
    here = os.path.dirname(HERE)
    results, copies = {}, []
    shared = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory() as tmp, checkout(against) as previous, \
            tempfile.TemporaryDirectory(dir=shared, prefix="sailfin-bench-") as shm:
        backends = ([("sp", False)] if "sp" in only else []) + (
            [("2-process ddp", True)] if device == "cpu" and "ddp" in only else [])
        for name, ddp in backends:
            def arm(memory: bool, root: str, tag: str):
                def go(i: int) -> dict:
                    spec = {"memory": memory, "ddp": ddp, "steps": steps, "threads": threads,
                            "every": every, "device": device, "copy": not memory and root == here
                            and (not ddp or "sp" not in only),
                            "out": os.path.join(tmp, f"{name}-{tag}-{i}"),
                            "shm": os.path.join(shm, f"{name}-{tag}-{i}"),
                            "blocks": blocks if tag.endswith("blocks") else 0}
                    return launch(spec, root)
                return go

            arms = {"with": arm(True, here, "with"), "without": arm(False, here, "without")}
            if previous is not None:
                arms.update({"previous with": arm(True, previous, "prev-with"),
                             "previous without": arm(False, previous, "prev-without")})
            if blocks:  # inside one run: on and off in alternate blocks of steps
                arms["blocks"] = arm(True, here, "blocks")
                if previous is not None:
                    arms["previous blocks"] = arm(True, previous, "prev-blocks")
            results[name] = interleave(rounds, arms)
            copies += [r["without"]["copy"] for r in results[name] if r["without"]["copy"]]
    copy = statistics.median(copies)
    where = f"GPT-2 small on {device}" if device == "cuda" else (
        f"{sum(a * b + b for a, b in zip(DIMS, DIMS[1:])) / 1e6:.1f} M-parameter MLP")
    print(f"memory snapshots every {every} step(s), {where}, AdamW, {steps} steps per run, "
          f"{rounds} rounds, {threads} thread(s) per process")
    print(f"  one plain copy of the state (model and optimizer) on this machine: "
          f"{copy * 1e3:.2f} ms")
    sp_ratios = []
    for name, rounds_ in results.items():
        for prefix, label in (("", "this release"), ("previous ", f"previous ({against})")):
            if f"{prefix}with" not in rounds_[0]:
                continue
            ratio = [r[f"{prefix}with"]["step"] / r[f"{prefix}without"]["step"] for r in rounds_]
            added = statistics.median((r[f"{prefix}with"]["step"] - r[f"{prefix}without"]["step"])
                                      * every for r in rounds_)
            waits = statistics.median(r[f"{prefix}with"]["waits"] for r in rounds_)
            waited = statistics.median(r[f"{prefix}with"]["waited"] for r in rounds_)
            held = statistics.median(r[f"{prefix}with"]["held"] for r in rounds_)
            print(f"  {name:>13}, {label}: step time with / without {spread(ratio)}; each "
                  f"snapshot adds {added * 1e3:+.2f} ms ({added / copy:.2f} x one plain "
                  f"copy); the training thread's own time per snapshot (its "
                  f"bookkeeping, and any wait for the copy; median) {held * 1e3:.2f} ms; "
                  f"steps that waited for the copy or write per run of {steps}: "
                  f"median {waits} ({waited * 1e3 / steps:.2f} ms a step)")
            if name == "sp" and not prefix:
                sp_ratios = ratio
        for prefix, label in (("", "this release"), ("previous ", f"previous ({against})")):
            arm_ = f"{prefix}blocks"
            if arm_ not in rounds_[0]:
                continue
            inside = [r[arm_]["on"] / r[arm_]["off"] for r in rounds_]
            added = statistics.median((r[arm_]["on"] - r[arm_]["off"]) * every
                                      for r in rounds_)
            print(f"  {name:>13}, {label}, inside one run (snapshots on and off in "
                  f"alternate blocks of {blocks} steps, median step of each): on / off "
                  f"{spread(inside)}; each snapshot adds {added * 1e3:+.2f} ms "
                  f"({added / copy:.2f} x one plain copy)")
    summary("memory_snapshots.py", f"sp step time with / without a snapshot every {every} "
            "step(s)", sp_ratios, load, threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--every", type=int, default=1, help="a snapshot every N steps")
    parser.add_argument("--against", metavar="REV", default=None,
                        help="also run git revision REV's sailfin (e.g. 562e3ce)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--backends", nargs="+", choices=["sp", "ddp"], default=["sp", "ddp"],
                        help="which backends to run (ddp: 2 processes; cpu only)")
    parser.add_argument("--blocks", type=int, default=0, metavar="B",
                        help="also, each round, one run of each release with snapshots on "
                        "and off in alternate blocks of B steps (the same process on both "
                        "sides: free of the step time's spread between processes)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    add_load_options(parser)
    opts = parser.parse_args()
    if opts.child:
        print(json.dumps(child(json.loads(opts.child))))
        return
    if opts.blocks and opts.every != 1:  # the median step of a block is a snapshot's step
        parser.error("--blocks compares steps with and without a snapshot: use it with --every 1")
    torch.set_num_threads(opts.threads)
    load = start(opts, "memory_snapshots.py")
    measure(opts.rounds, opts.steps, opts.threads, load, opts.every, opts.against, opts.device,
            tuple(opts.backends), opts.blocks)


if __name__ == "__main__":
    main()
