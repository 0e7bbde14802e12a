"""Checkpoint costs: the training stall per save (sync vs async), and resume time at the
start vs the end of an epoch.

1. Stall. An MLP of about 12.6 M parameters (50 MB in fp32, plus 50 MB of SGD
   momentum) trains with a save every few steps, once with ``async_save: false``
   and once with ``true``, interleaved (A B, B A, ...). The stall of a save is the
   time training waits for it (``CheckpointCallback.stall_seconds``): the whole
   write for a sync save; the copy to CPU memory (plus any wait for the previous
   save) for an async one. The figure is the median over rounds of the per-round
   ratio (median async stall / median sync stall of that round). A third arm
   trains without saves in the same rounds: (run time - the no-save run's) /
   saves is a save's true cost, whatever it does in the background (a
   background write still takes CPU and memory bandwidth from training). Every
   clock starts after ``Trainer.setup()``. A fourth arm takes a memory snapshot
   (``trainer.checkpoint.memory.every_n_steps: 1``, in /dev/shm) every step and
   saves nothing to disk: its stall per step, as a share of the no-save step.
   Then ``memory_snapshots.py``: step time with a snapshot every step over step
   time without, like for like under sp and 2-process ddp, and the node's
   /dev/shm bytes per snapshot against one rank's state.

2. Resume. A 100k-sample epoch of 6250 steps is checkpointed after its first
   step and before its last; a fresh trainer resumes from each in turn
   (interleaved). Measured: ``setup()`` (build, load the checkpoint, restore
   every piece and the data position) and the time to the end of the first
   resumed step. sailfin jumps to the saved data position, so the restore costs
   the same at both points; the ratios end/start are printed next to what
   replaying the skipped batches through the data loader would have cost. (The
   first step includes planning the rest of the epoch's sample order, which is
   less work near its end: a resume never costs more than starting an epoch.)

3. Per backend, against a baseline. ``--backends sp,ddp,fsdp``: the sync and the
   async stall per save of the same MLP (smaller: ``--backend-dims``) on each
   backend (ddp and fsdp on 2 processes, gloo), each arm in a process of its own
   whose sailfin is this tree or ``--baseline REV`` (default 562e3ce, the release
   before the state layer's rebuild), checked out for the run with ``git worktree
   add`` and removed after; arms interleaved per round. Printed: the median stall
   of rank 0 per save, and this tree over the baseline per backend and mode.

    python benchmarks/checkpoint.py [--rounds 5] [--threads 1] [--no-resume] [--no-memory]
    python benchmarks/checkpoint.py --only-backends --rounds 2 [--baseline 562e3ce]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

if "--child" not in sys.argv:  # a child's sailfin is its arm's tree (PYTHONPATH)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import add_load_options, interleave, spread, start, summary  # noqa: E402

from sailfin import Callback, DataInterface, ModuleInterface, Trainer, TrainerArguments  # noqa
from sailfin.config import CheckpointArguments  # noqa: E402


class Data(DataInterface):
    def __init__(self, n: int, dim: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ds = torch.utils.data.TensorDataset(torch.randn(n, dim, generator=g),
                                                 torch.randint(0, 10, (n,), generator=g))

    def get_train_dataset(self):
        return self.ds


class Recipe(ModuleInterface):
    def __init__(self, data: Data, dims: list[int]) -> None:
        super().__init__()
        self.data = data
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for a, b in zip(dims, dims[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*layers[:-1])

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)], []

    def train_step(self, global_step, batch, device):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x.to(device)), y.to(device))


# -- 1. the stall per save ------------------------------------------------------------------
BIG = [1024, 2048, 2048, 2048, 1024, 10]   # 12.6 M parameters


def stall_run(out_dir: str, mode: str, steps: int, every: int) -> tuple[list[float], float]:
    """mode: "sync", "async", "none" (no saves) or "memory" (a memory snapshot every step,
    no disk saves). Returns (stall per save or snapshot, run seconds)."""
    module = Recipe(Data(steps * 8, BIG[0]), BIG)
    saves = mode in ("sync", "async")
    memory = {"every_n_steps": 1} if mode == "memory" else {}
    args = TrainerArguments(epochs=1, train_batch_size=8, output_dir=out_dir, writers=[],
                            val_every_n_epochs=0, log_every_n_steps=1000, resume="never",
                            checkpoint=CheckpointArguments(every_n_steps=every if saves else None,
                                                           at_epoch_end=False, keep_last=1,
                                                           async_save=mode == "async",
                                                           memory=memory))
    trainer = Trainer(module, args)
    trainer.setup()
    begin = time.perf_counter()
    trainer.train()   # ends when the last save is on disk
    total = time.perf_counter() - begin
    saver = next((c for c in trainer.callbacks if hasattr(c, "stall_seconds")), None)
    return (saver.stall_seconds if saver else []), total


# -- 2. resume at the start vs the end of an epoch ----------------------------------------------
SMALL = [16, 32, 10]
N_SAMPLES, BATCH = 100_000, 16           # 6250 steps per epoch


class FirstStep(Callback):
    """Records when the first resumed step ends, then stops the run."""

    def __init__(self) -> None:
        self.at: float = 0.0

    def on_step_end(self, trainer):
        self.at = time.perf_counter()
        raise StopIteration


def small_args(out_dir: str, **kw) -> TrainerArguments:
    return TrainerArguments(epochs=1, train_batch_size=BATCH, output_dir=out_dir, writers=[],
                            val_every_n_epochs=0, log_every_n_steps=100_000, **kw)


def make_checkpoint(out_dir: str, data: Data, steps: int) -> str:
    Trainer(Recipe(data, SMALL), small_args(out_dir, max_steps=steps)).train()
    return os.path.join(out_dir, "checkpoints", f"step-{steps:08d}")


def resume_time(checkpoint: str, out_dir: str, data: Data) -> tuple[float, float]:
    """Seconds to set up (load and restore) and to the end of the first resumed step."""
    watch = FirstStep()
    start = time.perf_counter()
    trainer = Trainer(Recipe(data, SMALL), small_args(out_dir, resume=checkpoint),
                      callbacks=[watch])
    trainer.setup()
    ready = time.perf_counter()
    with contextlib.suppress(StopIteration):
        trainer.train()
    return ready - start, watch.at - start


def replay_time(data: Data, batches: int) -> float:
    """What skipping ``batches`` by reading them through the loader would cost."""
    loader = torch.utils.data.DataLoader(data.ds, batch_size=BATCH, shuffle=True)
    start = time.perf_counter()
    for i, _ in enumerate(loader):
        if i + 1 == batches:
            break
    return time.perf_counter() - start


# -- 3. per backend, this tree against a baseline -----------------------------------------
HERE = os.path.dirname(os.path.abspath(__file__))


def _rank_stalls(rank: int, world: int, port: int, spec: dict) -> None:
    """One rank of a backend arm (a child process whose sailfin is the arm's)."""
    from sailfin.config.distributed import DistArguments

    torch.set_num_threads(1)
    dist = (DistArguments(launcher="manual", rank=rank, world_size=world, master_addr="127.0.0.1",
                          master_port=port, timeout_seconds=120) if world > 1 else DistArguments())
    module = Recipe(Data(spec["steps"] * 8, spec["dims"][0]), spec["dims"])
    args = TrainerArguments(epochs=1, train_batch_size=8, micro_batch_size=8 // world,
                            output_dir=spec["out"], writers=[], val_every_n_epochs=0,
                            log_every_n_steps=1000, resume="never", backend=spec["backend"],
                            distributed=dist,
                            checkpoint=CheckpointArguments(every_n_steps=spec["every"],
                                                           at_epoch_end=False, keep_last=1,
                                                           async_save=spec["async"]))
    trainer = Trainer(module, args)
    trainer.train()
    if rank == 0:
        saver = next(c for c in trainer.callbacks if hasattr(c, "stall_seconds"))
        with open(os.path.join(spec["out"], "stalls.json"), "w") as fh:
            json.dump(saver.stall_seconds, fh)


def _child(spec: dict) -> None:
    world = 1 if spec["backend"] == "sp" else 2
    if world == 1:
        _rank_stalls(0, 1, 0, spec)
        return
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.multiprocessing.spawn(_rank_stalls, args=(world, port, spec), nprocs=world)


def backend_stalls(tree: str, spec: dict) -> list[float]:
    """Rank 0's stall per save of one arm, run with ``tree``'s sailfin."""
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, os.path.join(HERE, "checkpoint.py"), "--child",
                           json.dumps(spec)], env=env, capture_output=True, text=True,
                          timeout=900, cwd=tree)
    if done.returncode != 0:
        raise RuntimeError(f"{spec['backend']} arm of {tree} failed:\n{done.stderr[-3000:]}")
    with open(os.path.join(spec["out"], "stalls.json")) as fh:
        return json.load(fh)


@contextlib.contextmanager
def baseline_tree(rev: str):
    """A temporary checkout of ``rev`` (``git worktree add``), removed afterwards."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=HERE, text=True,
                          capture_output=True, check=True).stdout.strip()
    path = tempfile.mkdtemp(prefix="sailfin-baseline-")
    subprocess.run(["git", "worktree", "add", "--detach", path, rev], cwd=root, check=True,
                   capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", path], cwd=root,
                       capture_output=True)


def measure_backends(opts: argparse.Namespace) -> None:
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still removes the
    tree = os.path.dirname(HERE)                             # baseline's worktree
    dims = [int(d) for d in opts.backend_dims.split(",")]
    backends = opts.backends.split(",")
    with baseline_tree(opts.baseline) as base, tempfile.TemporaryDirectory() as tmp:
        trees = {"this": tree, opts.baseline: base}
        arms = {}
        for backend in backends:
            for mode in ("sync", "async"):
                for name, where in trees.items():
                    def arm(i, backend=backend, mode=mode, name=name, where=where):
                        spec = {"backend": backend, "async": mode == "async", "dims": dims,
                                "steps": opts.steps, "every": opts.every,
                                "out": os.path.join(tmp, f"{backend}-{mode}-{name}-{i}")}
                        return statistics.median(backend_stalls(where, spec))
                    arms[f"{backend} {mode} {name}"] = arm
        rounds = interleave(opts.rounds, arms)
    params = sum(a * b + b for a, b in zip(dims, dims[1:]))
    print(f"per backend: {params / 1e6:.1f} M parameters, a save every {opts.every} of "
          f"{opts.steps} steps, {opts.rounds} rounds; rank 0's stall per save (median)")
    for backend in backends:
        for mode in ("sync", "async"):
            this = [r[f"{backend} {mode} this"] for r in rounds]
            then = [r[f"{backend} {mode} {opts.baseline}"] for r in rounds]
            ratio = [a / b for a, b in zip(this, then)]
            print(f"  {backend:>5} {mode:>5}: this tree {statistics.median(this) * 1000:7.1f} ms, "
                  f"{opts.baseline} {statistics.median(then) * 1000:7.1f} ms; this / "
                  f"{opts.baseline} per round {spread(ratio)}")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=24, help="steps per stall run")
    parser.add_argument("--every", type=int, default=8, help="save every N steps")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-resume", action="store_true", help="only the stall figures")
    parser.add_argument("--no-memory", action="store_true",
                        help="leave out the arm with a memory snapshot every step")
    parser.add_argument("--backends", default="sp,ddp,fsdp",
                        help="the per-backend arms (sync and async, this tree and --baseline)")
    parser.add_argument("--baseline", default="562e3ce", help="git revision of the baseline")
    parser.add_argument("--backend-dims", default="512,1024,1024,512,10",
                        help="the per-backend arms' layer widths")
    parser.add_argument("--only-backends", action="store_true",
                        help="only the per-backend arms against the baseline")
    parser.add_argument("--no-backends", action="store_true",
                        help="leave out the per-backend arms against the baseline")
    add_load_options(parser)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    load = start(opts, "checkpoint.py")
    if opts.only_backends:
        measure_backends(opts)
        return
    params = sum(a * b + b for a, b in zip(BIG, BIG[1:]))
    saves = opts.steps // opts.every
    sink = io.StringIO()
    with tempfile.TemporaryDirectory() as tmp:
        stalls: dict[str, list[float]] = {"sync": [], "async": []}
        firsts: dict[str, list[float]] = {"sync": [], "async": []}  # no previous save to wait for

        def arm(mode):
            def run(i):
                with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                    stall, total = stall_run(os.path.join(tmp, f"stall-{i}-{mode}"), mode,
                                             opts.steps, opts.every)
                if mode in stalls and i:
                    stalls[mode] += stall
                    firsts[mode].append(stall[0])
                return (statistics.median(stall) if stall else 0.0), total
            return run

        stalls["memory"], firsts["memory"] = [], []
        modes = ("sync", "async", "none") + (() if opts.no_memory else ("memory",))
        rounds = interleave(opts.rounds, {m: arm(m) for m in modes})
        per_round = [r["async"][0] / r["sync"][0] for r in rounds]
        cost = {m: [(r[m][1] - r["none"][1]) / saves for r in rounds] for m in ("sync", "async")}
        memory_stall = stalls.pop("memory")
        print(f"model: {params / 1e6:.1f} M parameters ({params * 4 / 2**20:.0f} MB, "
              f"checkpoint ~{params * 8 / 2**20:.0f} MB with SGD momentum); a save every "
              f"{opts.every} steps ({saves} per run), {opts.rounds} rounds, "
              f"{opts.threads} thread(s)")
        for mode in stalls:
            values = [x * 1000 for x in stalls[mode]]
            print(f"stall per save, {mode:>5}: median {statistics.median(values):8.1f} ms "
                  f"(min {min(values):.1f}, max {max(values):.1f}, n={len(values)}); true cost "
                  f"per save (run time over the no-save run): median "
                  f"{statistics.median(cost[mode]) * 1000:.1f} ms; first save of a run (no "
                  f"wait for a previous one): {statistics.median(firsts[mode]) * 1000:.1f} ms")
        if memory_stall:
            step = statistics.median(r["none"][1] for r in rounds) / opts.steps
            extra = [(r["memory"][1] - r["none"][1]) / opts.steps for r in rounds]
            print(f"memory snapshot every step: stall median "
                  f"{statistics.median(memory_stall) * 1000:.1f} ms per step = "
                  f"{statistics.median(memory_stall) / step * 100:.1f} % of a {step * 1000:.0f} "
                  f"ms step (n={len(memory_stall)}); true cost per step (run time over the "
                  f"no-save run): median {statistics.median(extra) * 1000:.1f} ms = "
                  f"{statistics.median(extra) / step * 100:.1f} %")
        true_ratio = [a / s for a, s in zip(cost["async"], cost["sync"])]
        print(f"async / sync stall, per round: {spread(per_round)}")
        print(f"async / sync true cost per save, per round: {spread(true_ratio)}")
        if not opts.no_memory:  # like for like: sp and 2-process ddp, and the node's bytes
            import memory_snapshots

            print()
            memory_snapshots.measure(opts.rounds, memory_snapshots.STEPS, opts.threads, load)
        summary("checkpoint.py", "async / sync stall per save (per-round)", per_round, load,
                opts.threads, extra=f"true cost per save async / sync "
                f"{statistics.median(true_ratio):.3f} "
                f"({statistics.median(cost['async']) * 1000:.0f} vs "
                f"{statistics.median(cost['sync']) * 1000:.0f} ms)")
        if not opts.no_backends:
            print()
            measure_backends(opts)
        if opts.no_resume:
            return

        data = Data(N_SAMPLES, SMALL[0])
        steps = -(-N_SAMPLES // BATCH)
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            early = make_checkpoint(os.path.join(tmp, "early"), data, 1)
            late = make_checkpoint(os.path.join(tmp, "late"), data, steps - 1)
        times: dict[str, list[tuple[float, float]]] = {"start": [], "end": []}
        resume_rounds = 4 * opts.rounds  # each is a few ms: more rounds, steadier medians
        for i in range(resume_rounds + 1):
            order = [("start", early), ("end", late)]
            if i % 2:
                order.reverse()
            for name, path in order:
                gc.collect()
                with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                    seconds = resume_time(path, os.path.join(tmp, f"resume-{i}-{name}"), data)
                if i:
                    times[name].append(seconds)
        print(f"\nresume in an epoch of {steps} steps, after step 1 vs after step {steps - 1} "
              f"(medians of {resume_rounds}):")
        for i, what in enumerate(("setup (load + restore)", "to the end of the first step")):
            start_s = statistics.median(t[i] for t in times["start"])
            end_s = statistics.median(t[i] for t in times["end"])
            print(f"  {what:>28}: {start_s * 1000:7.1f} ms vs {end_s * 1000:7.1f} ms, "
                  f"end / start {end_s / start_s:.3f}")
        print(f"  replaying the {steps - 2} skipped batches through the loader instead would "
              f"take {replay_time(data, steps - 2) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
