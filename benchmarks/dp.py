"""DP-SGD's cost and its accounting: ``python benchmarks/dp.py``.

1. Steps/s and peak memory of plain training, flat clipping and ghost clipping under
   ``sp-dp``, ``ddp-dp`` and ``fsdp-dp`` (2 processes for the last two) on one model
   (the digits MLP, per-sample losses), each measured in fresh child processes per
   round (peak memory: the largest rank's peak RSS above its RSS before training, or
   CUDA's peak allocation), rounds interleaved; ratios are medians of per-round ratios
   to the plain strategy (``sp``, ``ddp``, ``fsdp``). ``fsdp-dp`` with flat clipping is
   refused (Opacus trains FSDP models with ghost clipping only): printed as such.
2. What ``max_epsilon`` and the logged epsilon add to a step: ``sp-dp`` with
   ``max_epsilon`` (never reached) and epsilon logged every step against the same run
   without either, alternated in one process, on a small MLP (``--budget-hidden``: fast
   steps, so a per-step cost shows); the figure: median per-round ratio of seconds per
   step (under 1.01 is the claim), and, less moved by the machine's load, the share of
   each step spent in the privacy callback's per-step hook, timed inside the same
   steps (under 0.01 is the claim). ``--budget-only`` prints that share alone.
3. epsilon after one epoch of the digits DP example against Opacus's ``RDPAccountant``
   called directly with the same sampling rate, noise and steps (must agree to 1e-6).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from _measure import add_load_options, interleave, ratios, spread, start, summary  # noqa: E402
from examples.digits.recipe import DigitsClassifier, DigitsData  # noqa: E402
from sailfin import Callback, Trainer, TrainerArguments  # noqa: E402
from sailfin.config.distributed import DistArguments  # noqa: E402
from sailfin.utils.memory import peak_rss_bytes  # noqa: E402

STRATEGIES = {"sp": 1, "ddp": 2, "fsdp": 2}          # strategy -> processes
CLIPPINGS = (None, "flat", "ghost")                   # None: the plain strategy
REFUSED = {("fsdp", "flat"): "refused: Opacus trains FSDP models with ghost clipping only"}


def modes() -> list[tuple[str, str, str | None]]:
    """(name, strategy, clipping) of every variant that runs."""
    return [(f"{s}-dp {c}" if c else s, s, c) for s in STRATEGIES for c in CLIPPINGS
            if (s, c) not in REFUSED]


class PerSample(DigitsClassifier):
    """The digits MLP; under dp its train_step returns per-sample losses (ghost needs them)."""

    per_sample = True

    def train_step(self, global_step, batch, device):
        x, y = batch[0].to(device), batch[1].to(device)
        loss = nn.functional.cross_entropy(self(x), y, reduction="none")
        return loss if self.per_sample else loss.mean()

    def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
        return [torch.optim.SGD(self.parameters(), lr=self.lr)], []


class Clock(Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.started = warmup, None

    def on_step_end(self, trainer) -> None:
        if trainer.global_step == self.warmup:
            self.started = time.perf_counter()


def trainer_for(strategy: str, clipping: str | None, steps: int, hidden: int, batch: int,
                dist: DistArguments | None = None, log_every: int = 50,
                **dp: object) -> tuple[Trainer, Clock]:
    torch.manual_seed(0)
    module = PerSample(DigitsData(), hidden=hidden, lr=0.01, dropout=0.0)
    module.per_sample = clipping is not None
    dp_args = {"noise_multiplier": 1.0, "clipping": clipping, **dp} if clipping else {}
    args = TrainerArguments(backend=f"{strategy}-dp" if clipping else strategy, epochs=100,
                            max_steps=steps, train_batch_size=batch, micro_batch_size=batch //
                            STRATEGIES[strategy], writers=[], progress="none",
                            val_every_n_epochs=0, sanity_val_batches=0, count_flops=False,
                            output_dir=tempfile.mkdtemp(prefix="sailfin-dp-bench-"),
                            resume="never", dp=dp_args, log_every_n_steps=log_every,
                            checkpoint={"at_epoch_end": False},
                            **({"distributed": dist} if dist is not None else {}))
    clock = Clock(warmup=5)
    return Trainer(module, args, callbacks=[clock]), clock


def child(mode: str, steps: int, hidden: int, batch: int, rank: int, port: int) -> None:
    _, strategy, clipping = next(m for m in modes() if m[0] == mode)
    world = STRATEGIES[strategy]
    dist = (DistArguments(launcher="manual", rank=rank, world_size=world,
                          master_addr="127.0.0.1", master_port=port, threads_per_process=1)
            if world > 1 else None)
    trainer, clock = trainer_for(strategy, clipping, steps, hidden, batch, dist)
    cuda = trainer.backend.device.type == "cuda"
    base = peak_rss_bytes()
    trainer.train()
    rate = (steps - clock.warmup) / (time.perf_counter() - clock.started)
    peak = torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes() - base
    trainer.close()
    print(json.dumps({"steps_per_second": rate, "peak_bytes": peak}))


def run_child(mode: str, opts: argparse.Namespace) -> dict:
    world = STRATEGIES[next(m for m in modes() if m[0] == mode)[1]]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, __file__, "--child", mode, "--steps",
                               str(opts.steps), "--hidden", str(opts.hidden), "--batch",
                               str(opts.batch), "--rank", str(r), "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
             for r in range(world)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        if p.returncode:
            raise SystemExit(f"{mode}: a child failed:\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return {"steps_per_second": results[0]["steps_per_second"],
            "peak_bytes": max(r["peak_bytes"] for r in results)}


def budget_overhead(rounds: int, steps: int, hidden: int, batch: int) -> list[float]:
    """Seconds per step with max_epsilon and epsilon logged every step over seconds per
    step without them, per round (one process, the two runs alternated)."""
    out = []
    for i in range(rounds + 1):
        seconds = {}
        for guarded in ((False, True) if i % 2 else (True, False)):
            extra = {"max_epsilon": 1e6} if guarded else {}
            trainer, clock = trainer_for("sp", "flat", steps, hidden, batch,
                                         log_every=1 if guarded else 10**9, **extra)
            trainer.train()
            seconds[guarded] = (time.perf_counter() - clock.started) / (steps - clock.warmup)
            trainer.close()
        if i:  # the first round warms up
            out.append(seconds[True] / seconds[False])
    return out


def guard_share(steps: int, hidden: int, batch: int) -> tuple[float, float]:
    """Seconds per step inside the privacy callback's per-step hook (the epsilon looked
    up and logged every step, the max_epsilon comparison) and that over the seconds per
    step, both measured in the same steps (the machine's load moves both alike)."""
    from sailfin.trainer.features.privacy import PrivacyCallback

    spent = [0.0, 0]
    real = PrivacyCallback.on_step_end

    def timed(self, trainer) -> None:
        began = time.perf_counter()
        real(self, trainer)
        if clock.started is not None:
            spent[0] += time.perf_counter() - began
            spent[1] += 1

    trainer, clock = trainer_for("sp", "flat", steps, hidden, batch, log_every=1,
                                 max_epsilon=1e6)
    PrivacyCallback.on_step_end = timed
    try:
        trainer.train()
        per_step = (time.perf_counter() - clock.started) / (steps - clock.warmup)
    finally:
        PrivacyCallback.on_step_end = real
        trainer.close()
    return spent[0] / spent[1], spent[0] / spent[1] / per_step


def epsilon_check() -> float:
    from opacus.accountants import RDPAccountant

    data = DigitsData()
    args = TrainerArguments(backend="sp-dp", epochs=1, train_batch_size=64, micro_batch_size=32,
                            writers=[], progress="none", resume="never",
                            output_dir=tempfile.mkdtemp(prefix="sailfin-dp-bench-"),
                            dp={"noise_multiplier": 1.0, "max_grad_norm": 1.0})
    result = Trainer(DigitsClassifier(data, lr=0.01, dropout=0.0), args).train()["privacy"]
    n = len(data.train)
    direct = RDPAccountant()
    direct.history = [(1.0, 64 / n, -(-n // 64))]  # sigma, q, ceil(N / batch) steps
    expected = direct.get_epsilon(delta=1 / n)
    diff = abs(result["epsilon"] - expected)
    print(f"epsilon after one digits epoch: sailfin {result['epsilon']:.9f}, Opacus "
          f"RDPAccountant {expected:.9f}, |diff| {diff:.2e} (steps {result['accounted_steps']}, "
          f"q {64 / n:.5f}, delta 1/{n})")
    if diff > 1e-6:
        raise SystemExit("epsilon disagrees with Opacus's RDPAccountant by more than 1e-6")
    return diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--child", choices=[m[0] for m in modes()])
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--budget-hidden", type=int, default=64,
                        help="hidden width of the max_epsilon figure's MLP (small: fast steps, "
                             "so what the guard adds shows)")
    parser.add_argument("--budget-only", action="store_true",
                        help="only the max_epsilon figure (2.)")
    add_load_options(parser)
    opts = parser.parse_args()
    if opts.child:
        return child(opts.child, opts.steps, opts.hidden, opts.batch, opts.rank, opts.port)
    load = start(opts, "dp")
    if opts.budget_only:
        shares = [guard_share(opts.steps * 2, opts.budget_hidden, opts.batch)
                  for _ in range(opts.rounds)]
        print(f"privacy hook per step: {statistics.median(s[0] for s in shares) * 1e6:.1f} us")
        summary("dp", "share of a step in the privacy hook (max_epsilon + epsilon logged "
                "every step)", [s[1] for s in shares], load, torch.get_num_threads())
        return
    diff = epsilon_check()
    peaks: dict[str, list[float]] = {m[0]: [] for m in modes()}

    def variant(mode):
        def run(_round: int) -> float:
            figures = run_child(mode, opts)
            peaks[mode].append(figures["peak_bytes"])
            return figures["steps_per_second"]
        return run

    rounds = interleave(opts.rounds, {m[0]: variant(m[0]) for m in modes()}, warmup=0)
    print(f"digits MLP (64 -> {opts.hidden} -> {opts.hidden} -> 10), expected batch "
          f"{opts.batch}, {opts.steps} steps; ratio: median per-round steps/s over the plain "
          "strategy's")
    for name, strategy, clipping in modes():
        rates = [r[name] for r in rounds]
        mib = statistics.median(peaks[name]) / 2**20
        ratio = ("" if clipping is None else
                 f"; x{statistics.median(ratios(rounds, name, strategy)):.2f}")
        print(f"{name:14s} steps/s {spread(rates)}{ratio}; peak memory (median, largest rank)"
              f" {mib:.1f} MiB")
    for (strategy, clipping), why in REFUSED.items():
        print(f"{strategy}-dp {clipping:6s} {why}")
    guard = budget_overhead(opts.rounds, opts.steps * 2, opts.budget_hidden, opts.batch)
    print(f"max_epsilon + epsilon logged every step, seconds per step over without: "
          f"{spread(guard)}")
    shares = [guard_share(opts.steps * 2, opts.budget_hidden, opts.batch)
              for _ in range(opts.rounds)]
    print(f"the privacy hook's share of a step (same steps): {spread([s[1] for s in shares])}"
          f"; {statistics.median(s[0] for s in shares) * 1e6:.1f} us per step")
    flat = ratios(rounds, "sp-dp flat", "sp")
    summary("dp", "steps/s of sp-dp flat / sp", flat, load, torch.get_num_threads(),
            extra=f"max_epsilon step cost {spread(guard)}, its hook's share of a step "
                  f"{statistics.median(s[1] for s in shares):.4f}; epsilon |diff| vs "
                  f"RDPAccountant {diff:.1e}")


if __name__ == "__main__":
    main()
