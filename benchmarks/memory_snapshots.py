"""Memory snapshots every step, like for like: step time with a snapshot every step over
step time without, under sp and under 2-process ddp (gloo, one node), and what the node's
snapshot directory holds per snapshot against the state's size.

Each round runs both arms back to back, in alternating order. A run's step time is
its steady state: from the end of its first step to the end of its last, over the
steps between. What happens once per run is printed apart, not hidden: the first
step (the staging files are created and the first copy touches their pages) and
the run's end (the last write is awaited, the files removed), as the extra
milliseconds a run with snapshots spends there. The figure is the median of the
per-round ratios. The bytes
are measured in the ddp run with snapshots, at its last step, once both ranks'
writes are done: the step directories of every rank for one step, the staging
files, and one rank's state (model, optimizer, trainer state, random streams).

    python benchmarks/memory_snapshots.py [--rounds 5] [--steps 30] [--threads 1]
    (benchmarks/checkpoint.py runs it too, unless --no-memory)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import add_load_options, interleave, spread, start, summary  # noqa: E402

from sailfin import Callback, DataInterface, ModuleInterface, Trainer, TrainerArguments  # noqa
from sailfin.config.distributed import DistArguments  # noqa: E402

DIMS = [512, 1024, 1024, 512, 10]  # 2.1 M parameters: 8 MB, and 16 MB of AdamW state
BATCH = 64  # per process and step
STEPS = 60  # per run


class Data(DataInterface):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ds = torch.utils.data.TensorDataset(torch.randn(n, DIMS[0], generator=g),
                                                 torch.randint(0, 10, (n,), generator=g))

    def get_train_dataset(self):
        return self.ds


class Recipe(ModuleInterface):
    def __init__(self, data: Data) -> None:
        super().__init__()
        self.data = data
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for a, b in zip(DIMS, DIMS[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*layers[:-1])

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [torch.optim.AdamW(self.parameters(), lr=1e-3)], []

    def train_step(self, global_step, batch, device):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x.to(device)), y.to(device))


def memory_callback(trainer):
    from sailfin.trainer.checkpointing.memory_snapshots import MemorySnapshots

    return next(c for c in trainer.callbacks if isinstance(c, MemorySnapshots))


class NodeBytes(Callback):
    """At the last step (writes done on every rank): bytes of one step's snapshot in the
    node's directory, of the staging files, and of one rank's state."""

    def __init__(self, last: int) -> None:
        self.last = last
        self.found: dict = {}

    def on_step_end(self, trainer) -> None:
        if trainer.global_step != self.last:
            return
        from sailfin.checkpoint.memory_dirs import used_bytes
        from sailfin.checkpoint.rng import rng_state
        from sailfin.trainer.checkpointing.memory_snapshots import state_bytes

        store = trainer.checkpointer.store
        store.wait()
        trainer.backend.barrier()
        if store.rank == 0:
            ranks = [d for d in os.listdir(store.root) if d.startswith("rank")]
            # The newest step every rank holds complete.
            step = max(set.intersection(*[
                {n for n in os.listdir(os.path.join(store.root, d)) if n.startswith("step-")}
                for d in ranks]))
            self.found = {
                "snapshot": sum(used_bytes(os.path.join(store.root, d, step)) for d in ranks),
                "staging": sum(used_bytes(os.path.join(store.root, d)) for d in
                               os.listdir(store.root) if d.startswith("staging")),
                "state": state_bytes(trainer.state_dict()) + state_bytes(rng_state()),
                "ranks": len(ranks), "waited": len(memory_callback(trainer).write_waits)}
        trainer.backend.barrier()


class DCPSnapshots(Callback):
    """The alternative measured beside sailfin's own snapshots: PyTorch's DCP machinery
    doing the same job, the way a recipe would wire it. Every step the same state
    (``Trainer.state_dict()``) goes to ``dcp.async_save`` with a ``DefaultStager`` (shared
    memory, staging on its thread, overlapping the next forward and backward) and the
    process-based writer, into two directories in /dev/shm taken in turn; the step waits
    for the staging just before the optimizer step, and then for the previous snapshot's
    write if it is not done (as sailfin waits: a kill loses at most one step). DCP's
    process-based writer needs a process group: under sp, a one-process gloo group on
    loopback."""

    def __init__(self, root: str, every: int = 1) -> None:
        self.root, self.every, self.waited = root, every, 0
        self.issued = self.done = 0  # the newest step sent, and the one before (written)
        self.staging = self.upload = self.stager = None
        self.group_made = False

    def _save(self, trainer, step: int):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        # A directory per step (DCP warns when it overwrites one); the one before the
        # newest complete goes once the next is issued.
        for old in [d for d in os.listdir(self.root) if d.startswith("step-")] if os.path.isdir(
                self.root) else []:
            if int(old[5:]) < self.done:
                shutil.rmtree(os.path.join(self.root, old), ignore_errors=True)
        self.done = self.issued
        self.issued = step
        return dcp.async_save(trainer.state_dict(),
                              checkpoint_id=os.path.join(self.root, f"step-{step}"),
                              async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                              async_stager=self.stager)

    def on_train_start(self, trainer) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if not dist.is_initialized():
            from socket import socket

            with socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group("gloo", rank=0, world_size=1,
                                    init_method=f"tcp://127.0.0.1:{port}")
            self.group_made = True
        self.stager = DefaultStager(StagingOptions(
            use_pinned_memory=False, use_shared_memory=True, use_async_staging=True,
            use_non_blocking_copy=False))
        # The writer process starts with the first save: not a step's cost (as sailfin's
        # writer is started before the clock runs).
        response = self._save(trainer, 0)
        response.upload_completion.result()

    def on_backward_end(self, trainer, *args, **kwargs):
        if self.staging is not None:
            self.staging.result()  # the copy must hold this step's weights, not the next
            self.staging = None
        if ((trainer.global_step + 1) % self.every == 0 and self.upload is not None
                and not self.upload.done()):
            self.waited += 1
            self.upload.result()
        return False

    def on_step_end(self, trainer) -> None:
        if trainer.global_step % self.every:
            return
        response = self._save(trainer, trainer.global_step)
        self.staging, self.upload = response.staging_completion, response.upload_completion

    def on_train_end(self, trainer) -> None:
        if self.upload is not None:
            self.upload.result()
        self.stager.close()
        if self.group_made:
            import torch.distributed as dist

            dist.destroy_process_group()


class Clock(Callback):
    """The time at the start of training and at the end of each step."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def on_train_start(self, trainer) -> None:
        self.marks.append(time.perf_counter())

    def on_step_end(self, trainer) -> None:
        self.marks.append(time.perf_counter())


def run(out: str, memory, steps: int, dist: DistArguments | None = None, every: int = 1
        ) -> tuple:
    """(seconds per step from the end of the first step to the end of the last, seconds
    of the first step, seconds from the last step's end until train() returned, the
    node's bytes)."""
    world = dist.world_size if dist is not None else 1
    args = TrainerArguments(
        epochs=1, train_batch_size=BATCH * world, micro_batch_size=BATCH, output_dir=out,
        writers=[],
        val_every_n_epochs=0, log_every_n_steps=10_000, resume="never", progress="none",
        backend="ddp" if dist is not None else "sp", distributed=dist or DistArguments(),
        checkpoint={"at_epoch_end": False,
                    "memory": {"every_n_steps": every} if memory is True else {}})
    node, clock = NodeBytes(steps), Clock()
    shm = os.path.join("/dev/shm", f"sailfin-bench-{os.getpid()}-{os.path.basename(out)}")
    extra = [node] if memory is True else [DCPSnapshots(shm, every)] if memory == "dcp" else []
    trainer = Trainer(Recipe(Data(steps * BATCH * world)), args, callbacks=[clock] + extra)
    trainer.setup()
    if memory is True:
        trainer.checkpointer.store.start_writer(wait=True)  # its start is not a step's cost
    trainer.train()
    ended = time.perf_counter()
    trainer.close()
    marks = clock.marks
    if memory == "dcp":
        node.found = {"waited": extra[0].waited}
        shutil.rmtree(shm, ignore_errors=True)
    return ((marks[-1] - marks[1]) / (steps - 1), marks[1] - marks[0], ended - marks[-1],
            node.found)


def _rank(rank: int, port: int, out: str, memory: bool, steps: int, threads: int,
          queue: multiprocessing.Queue, every: int) -> None:
    torch.set_num_threads(threads)
    dist = DistArguments(launcher="manual", rank=rank, world_size=2, local_rank=rank,
                         local_world_size=2, master_addr="127.0.0.1", master_port=port,
                         threads_per_process=threads)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        result = run(out, memory, steps, dist, every)
    if rank == 0:
        queue.put(result)


def run_ddp(out: str, memory: bool, steps: int, threads: int, every: int) -> tuple:
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out, memory, steps, threads, queue, every))
             for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=600)
    for p in procs:
        p.join(60)
    return result


def measure(rounds: int, steps: int, threads: int, load, every: int = 1) -> None:
    sink = io.StringIO()
    found: dict = {}
    once: dict = {}  # (arm, memory) -> [(first step, end) seconds]
    with tempfile.TemporaryDirectory() as tmp:
        def arm(memory, ddp: bool):
            def go(i: int) -> float:
                out = os.path.join(tmp, f"{'ddp' if ddp else 'sp'}-{memory}-{i}")
                if ddp:
                    step, first, end, node = run_ddp(out, memory, steps, threads, every)
                else:
                    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                        step, first, end, node = run(out, memory, steps, every=every)
                if node and memory is True:
                    found.setdefault("ddp" if ddp else "sp", []).append(node)
                if memory == "dcp":
                    found.setdefault("dcp", []).append(node)
                    return step
                once.setdefault(("ddp" if ddp else "sp", memory), []).append((first, end))
                return step
            return go

        figures, per_snapshot = {}, {}
        for name, ddp in (("sp", False), ("2-process ddp", True)):
            arms = {"with": arm(True, ddp), "without": arm(False, ddp)}
            if not ddp:  # the alternative: DCP's own async machinery, the same state
                arms["dcp"] = arm("dcp", ddp)
            results = interleave(rounds, arms)
            figures[name] = [r["with"] / r["without"] for r in results]
            if not ddp:
                figures["dcp"] = [r["dcp"] / r["without"] for r in results]
                figures["sailfin/dcp"] = [r["with"] / r["dcp"] for r in results]
            # What one snapshot costs the steps: a round's extra step time.
            per_snapshot[name] = [(r["with"] - r["without"]) * every for r in results]
    params = sum(a * b + b for a, b in zip(DIMS, DIMS[1:]))
    print(f"memory snapshots every {every} step(s), AdamW, {params / 1e6:.1f} M parameters, "
          f"{steps} steps per run, {rounds} rounds, {threads} thread(s) per process:")
    dcp_waited = [n["waited"] for n in found.get("dcp", [])]
    print(f"  the alternative, sp: DCP async_save (DefaultStager in shared memory, staging "
          f"overlapped, process writer) / without: {spread(figures['dcp'])}; "
          f"steps that waited for a write per run: median "
          f"{statistics.median(dcp_waited) if dcp_waited else 0}")
    print(f"  sailfin's snapshots over DCP's, sp: {spread(figures['sailfin/dcp'])} "
          "(below 1: sailfin's are cheaper)")
    for (name, values), key in zip(((k, figures[k]) for k in ("sp", "2-process ddp")),
                                   ("sp", "ddp")):
        waited = [n["waited"] for n in found.get(key, [])]
        print(f"  step time with snapshots / without, {name:>13}: "
              f"{spread(values)}; steps that waited for the previous snapshot's write "
              f"per run of {steps}: median {statistics.median(waited) if waited else 0}")
        if per_snapshot.get(name):
            cost = statistics.median(per_snapshot[name])
            print(f"    each snapshot costs the steps {cost * 1e3:+.2f} ms (median of the "
                  f"rounds' extra step time)")
        extra = [statistics.median(x[i] for x in once[(key, True)])
                 - statistics.median(x[i] for x in once[(key, False)]) for i in (0, 1)]
        print(f"    once per run, with snapshots: first step {extra[0] * 1e3:+.1f} ms, "
              f"end of the run {extra[1] * 1e3:+.1f} ms (medians, against without)")
    node = found["ddp"][-1] if found.get("ddp") else None
    if node:
        print(f"  2-process ddp, one node: /dev/shm per snapshot {node['snapshot'] / 2**20:.1f} "
              f"MiB ({node['ranks']} rank directories) for a state of "
              f"{node['state'] / 2**20:.1f} MiB per rank: "
              f"{node['snapshot'] / node['state']:.3f} x one rank's state; staging "
              f"{node['staging'] / 2**20:.1f} MiB")
    summary("memory_snapshots.py", f"sp step time with / without a snapshot every {every} "
            "step(s)",
            figures["sp"], load, threads,
            extra=f"2-process ddp {statistics.median(figures['2-process ddp']):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--every", type=int, default=1, help="a snapshot every N steps")
    add_load_options(parser)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    load = start(opts, "memory_snapshots.py")
    measure(opts.rounds, opts.steps, opts.threads, load, opts.every)


if __name__ == "__main__":
    main()
