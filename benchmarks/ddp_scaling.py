"""DDP on CPU: 1 process vs 2, and what ``no_sync`` saves during accumulation.

The same small transformer and the same global batch run as

* ``sp``: one process with 2 intra-op threads (all the cores), one forward of
  the whole global batch per step (no accumulation);
* ``ddp``: 2 processes (gloo on loopback) with 1 thread each, gradient
  all-reduce only on the last micro-batch of a step (sailfin's default);
* ``ddp-sync-every``: the same, but all-reducing after every micro-batch.

Rounds are interleaved (the order rotates). Every arm's clock is the trainer's
own: from the first step of the epoch to its last (``train_seconds``; set-up,
process start and rendezvous excluded). Each figure is the median over rounds
of the per-round ratio to ``sp``. All-reduce calls per optimizer step are
counted with a DDP communication hook.

    python benchmarks/ddp_scaling.py [--rounds 5] [--steps 40] [--accumulation 4]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import add_load_options, spread, start, summary  # noqa: E402

from sailfin import DataInterface, ModuleInterface, Trainer, TrainerArguments  # noqa: E402
from sailfin.backends import build_backend  # noqa: E402
from sailfin.config.distributed import DistArguments  # noqa: E402
from sailfin.distributed import DistEnv  # noqa: E402
from tests.distributed.workers import CountAllReduce  # noqa: E402

SEQ, VOCAB, DIM = 64, 256, 128


class Tokens(DataInterface):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ds = torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (n, SEQ + 1),
                                                               generator=g))

    def get_train_dataset(self):
        return self.ds


class TinyLM(ModuleInterface):
    def __init__(self, data: Tokens) -> None:
        super().__init__()
        self.data = data
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(DIM, 4, 4 * DIM, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ))

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [torch.optim.AdamW(self.parameters(), lr=1e-3)], []

    def train_step(self, global_step, batch, device):
        tokens = batch[0].to(device)
        h = self.body(self.embed(tokens[:, :-1]), mask=self.mask, is_causal=True)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), tokens[:, 1:].flatten())


def trainer_args(out: str, opts, world: int, accumulation: int, **kw) -> TrainerArguments:
    return TrainerArguments(epochs=1, train_batch_size=opts.global_batch,
                            micro_batch_size=opts.global_batch // (accumulation * world),
                            max_steps=opts.steps, output_dir=out, writers=[],
                            log_every_n_steps=10, val_every_n_epochs=0, progress="none",
                            checkpoint={"at_epoch_end": False}, resume="never", **kw)


def run_sp(opts, out: str) -> dict:
    torch.set_num_threads(2)
    module = TinyLM(Tokens(opts.global_batch * opts.steps))
    # One batch of the global size per step: what one process would run.
    summary = Trainer(module, trainer_args(out, opts, 1, 1)).train()
    return {"samples_per_second": summary["samples_per_second"], "allreduce_per_step": 0.0}


def _ddp_rank(rank: int, port: int, opts, out: str, sync_every: bool, queue) -> None:
    dist_args = DistArguments(launcher="manual", rank=rank, world_size=2,
                              master_addr="127.0.0.1", master_port=port,
                              threads_per_process=1, timeout_seconds=120)
    args = trainer_args(out, opts, 2, opts.accumulation, backend="ddp", distributed=dist_args)
    env = DistEnv.from_config(dist_args)
    backend = build_backend(args, env)
    if sync_every:  # the alternative: all-reduce after every micro-batch
        backend.sync_context = lambda sync: nullcontext()
    counter = CountAllReduce()
    module = TinyLM(Tokens(opts.global_batch * opts.steps))
    with Trainer(module, args, dist=env, backend=backend, callbacks=[counter]) as trainer:
        summary = trainer.train()
    if rank == 0:
        queue.put({"samples_per_second": summary["samples_per_second"],
                   "allreduce_per_step": counter.calls / summary["global_step"]})


def run_ddp(opts, out: str, sync_every: bool) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_ddp_rank, args=(r, port, opts, out, sync_every, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=600)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--accumulation", type=int, default=4,
                        help="micro-batches per step on each of the 2 DDP ranks")
    add_load_options(parser)
    opts = parser.parse_args()
    load = start(opts, "ddp_scaling.py")
    runs = {"sp (1 process x 2 threads)": lambda out: run_sp(opts, out),
            "ddp (2 x 1 thread, no_sync)": lambda out: run_ddp(opts, out, False),
            "ddp-sync-every (2 x 1 thread)": lambda out: run_ddp(opts, out, True)}
    results: dict[str, list[dict]] = {name: [] for name in runs}
    names = list(runs)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(opts.rounds):
            order = names[i % len(names):] + names[:i % len(names)]
            for name in order:
                # A directory per run: each one trains from scratch.
                results[name].append(runs[name](str(Path(tmp, f"{i}-{names.index(name)}"))))
            print(f"round {i + 1}: " + " | ".join(
                f"{n} {results[n][-1]['samples_per_second']:.0f}" for n in names), flush=True)
    rate = {n: [r["samples_per_second"] for r in results[n]] for n in names}
    print(f"\n{opts.steps} steps, global batch {opts.global_batch}; sp: one batch of "
          f"{opts.global_batch} per step; DDP: accumulation {opts.accumulation} per rank; "
          f"{opts.rounds} rounds")
    for name in names:
        calls = statistics.median(r["allreduce_per_step"] for r in results[name])
        ratio = [a / b for a, b in zip(rate[name], rate[names[0]])]
        print(f"{name:>32}: {statistics.median(rate[name]):8.1f} samples/s, per-round ratio "
              f"to sp {spread(ratio)}, {calls:.0f} all-reduce(s) per optimizer step")
    no_sync = [a / b for a, b in zip(rate[names[1]], rate[names[2]])]
    print(f"no_sync vs all-reducing every micro-batch, per round: {spread(no_sync)}")
    summary("ddp_scaling.py", "ddp (2 x 1 thread) / sp (1 x 2 threads) samples/s (per-round)",
            [a / b for a, b in zip(rate[names[1]], rate[names[0]])], load,
            "2 (sp), 1 per process (ddp)",
            extra=f"no_sync / sync-every {statistics.median(no_sync):.3f}")


if __name__ == "__main__":
    main()
