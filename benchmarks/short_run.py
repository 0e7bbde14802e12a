"""A short experiment end to end: sailfin with its DEFAULT settings against a hand-written
loop doing the same training, each in a fresh process, and where sailfin's fixed costs go.

A tiny MLP (64 -> 256 -> 256 -> 10, SGD), 2 epochs x 256 steps of batch 32
(8,192 random samples), the same order and the same batches in both (sailfin's
permutation for seed 42; the hand loop fetches whole batches by index as
sailfin does, ``_hand.batched_loader``), so both end with the same weights
(checked). sailfin runs as a user's first script would: ``Trainer(module,
args).train()`` then ``close()``, default writers (stdout, metrics.jsonl),
progress, a checkpoint at each epoch end, summary.json and
final/model.safetensors. The hand loop prints the loss every 10 steps and saves
its final weights with ``torch.save``.

Two clocks per run, both from inside a fresh process:

- after ``import torch`` (the figure): importing sailfin, building, training and
  every file written;
- from the process's start (``python`` itself and ``import torch`` included):
  measured by this script around the child process.

The figure is the median over interleaved rounds of hand seconds / sailfin
seconds (1.00 = no cost; goal >= 0.95). sailfin spares Python's garbage
collector the objects alive while it builds a run (``gc.freeze`` for the
set-up only), which a plain hand loop does not; so a third variant, ``hand-gc``,
is the hand loop doing the same, and its ratio is printed too: sailfin's own
cost against the fastest hand loop. It then prints where sailfin's time went:
import, set-up, start-up checks, each epoch, each save, the final files.

    python benchmarks/short_run.py [--rounds 5] [--steps 256] [--epochs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _measure import add_load_options, interleave, spread, start, summary  # noqa: E402

RESULT = "SHORT_RUN_RESULT "


def _timed(owner, name: str, phases: dict, label: str) -> None:
    """Wrap ``owner.name`` so each call adds its seconds to ``phases[label]`` (a list)."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        begin = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            phases.setdefault(label, []).append(time.perf_counter() - begin)

    setattr(owner, name, wrapper)


def child_hand(out_dir: str, steps: int, epochs: int, t0: float, spare_gc: bool = False
               ) -> dict:
    import gc

    import torch
    from torch import nn

    from _hand import batched_loader, fingerprint, make_data, make_model

    phases: dict[str, list[float]] = {}
    begin = time.perf_counter()
    if spare_gc:  # what sailfin does while it builds a run
        gc.freeze()
    ds = make_data(steps)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if spare_gc:
        gc.unfreeze()
    phases["build"] = [time.perf_counter() - begin]
    step = 0
    for epoch in range(epochs):
        begin = time.perf_counter()
        for x, y in batched_loader(ds, epoch=epoch):
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}")
        phases.setdefault("epoch", []).append(time.perf_counter() - begin)
    begin = time.perf_counter()
    torch.save(model.state_dict(), os.path.join(out_dir, "model.pt"))
    phases["final files"] = [time.perf_counter() - begin]
    return {"seconds": time.perf_counter() - t0, "phases": phases,
            "fingerprint": fingerprint(model)}


def child_sailfin(out_dir: str, steps: int, epochs: int, t0: float) -> dict:
    phases: dict[str, list[float]] = {}
    begin = time.perf_counter()
    import torch
    from torch import nn

    import sailfin.trainer.compose.trainer as loop
    from sailfin import DataInterface, ModuleInterface, Trainer, TrainerArguments
    from sailfin.trainer.checkpointing.saver import CheckpointCallback

    from _hand import fingerprint, make_data, make_model
    phases["import sailfin"] = [time.perf_counter() - begin]

    class Data(DataInterface):
        def get_train_dataset(self):
            return make_data(steps)

    class Recipe(ModuleInterface):
        def __init__(self):
            super().__init__()
            self.data = Data()
            self.net = make_model()

        def get_optimizers_schedulers(self, estimated_global_steps_per_epoch, epochs):
            return [torch.optim.SGD(self.parameters(), lr=0.01)], []

        def train_step(self, global_step, batch, device):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

    _timed(loop.Trainer, "setup", phases, "Trainer.setup")
    _timed(loop, "check_schedulers_fit", phases, "start-up checks")
    _timed(loop, "sanity_validate", phases, "start-up checks")
    _timed(loop.Trainer, "_train_epoch", phases, "epoch")
    _timed(CheckpointCallback, "save", phases, "epoch-end save")
    _timed(loop, "finish_run", phases, "final files (summary, weights)")
    begin = time.perf_counter()
    module = Recipe()
    trainer = Trainer(module, TrainerArguments(epochs=epochs, train_batch_size=32,
                                               output_dir=out_dir))
    phases["build (recipe, Trainer())"] = [time.perf_counter() - begin]
    begin = time.perf_counter()
    trainer.train()
    trainer.close()
    phases["train() + close()"] = [time.perf_counter() - begin]
    return {"seconds": time.perf_counter() - t0, "phases": phases,
            "fingerprint": fingerprint(module.net)}


def run_child(variant: str, out_dir: str, steps: int, epochs: int) -> dict:
    """One fresh process; its own figures plus the wall time from its start."""
    begin = time.perf_counter()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", variant,
                           out_dir, "--steps", str(steps), "--epochs", str(epochs)],
                          capture_output=True, text=True, env={**os.environ,
                                                               "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - begin
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{variant} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len(RESULT):])
    result["wall"] = wall
    return result


def breakdown(results: list[dict]) -> list[tuple[str, float, int]]:
    """(phase, median seconds per run, calls per run that did work (> 0.1 ms)) over runs."""
    names = list(dict.fromkeys(name for r in results for name in r["phases"]))
    return [(name, statistics.median(sum(r["phases"].get(name, [])) for r in results),
             max(sum(1 for t in r["phases"].get(name, []) if t > 1e-4) for r in results))
            for name in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=256, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "OUT_DIR"),
                        help=argparse.SUPPRESS)
    add_load_options(parser)
    opts = parser.parse_args()
    if opts.child:
        t0 = time.perf_counter()
        import torch
        torch.set_num_threads(1)
        t0 = time.perf_counter()  # the clock starts after import torch (both pay it)
        c0 = time.process_time()
        if opts.child[0] == "sailfin":
            result = child_sailfin(opts.child[1], opts.steps, opts.epochs, t0)
        else:
            result = child_hand(opts.child[1], opts.steps, opts.epochs, t0,
                                spare_gc=opts.child[0] == "hand-gc")
        result["cpu"] = time.process_time() - c0  # this process's CPU seconds, all threads
        print(RESULT + json.dumps(result), flush=True)
        return
    load = start(opts, "short_run.py")
    runs: dict[str, list[dict]] = {"hand": [], "hand-gc": [], "sailfin": []}
    with tempfile.TemporaryDirectory() as tmp:
        def variant(name):
            def run(i):
                runs[name].append(run_child(name, tempfile.mkdtemp(dir=tmp), opts.steps,
                                            opts.epochs))
                return runs[name][-1]["seconds"]
            return run

        rounds = interleave(opts.rounds, {name: variant(name) for name in runs}, warmup=1)
    for name in runs:
        runs[name] = runs[name][1:]  # the warm-up round's runs (page cache) are left out
    same = {r["fingerprint"] for name in runs for r in runs[name]}
    print(f"\n{opts.epochs} epochs x {opts.steps} steps of batch 32; same final weights in "
          f"every run: {'yes' if len(same) == 1 else 'NO'}")
    ratio = [r["hand"] / r["sailfin"] for r in rounds]
    spared = [r["hand-gc"] / r["sailfin"] for r in rounds]
    wall = [h["wall"] / s["wall"] for h, s in zip(runs["hand"], runs["sailfin"])]
    for name in runs:
        print(f"{name:>8}: after import torch median {statistics.median(r['seconds'] for r in runs[name]):.3f} s; "
              f"from process start {statistics.median(r['wall'] for r in runs[name]):.3f} s")
    print(f"hand / sailfin, after import torch: {spread(ratio)}")
    print(f"hand-gc / sailfin, after import torch (a hand loop that also spares the "
          f"garbage collector while it builds, as sailfin does): {spread(spared)}")
    print(f"hand / sailfin, from process start: {spread(wall)}")
    cpu = [h["cpu"] / s["cpu"] for h, s in zip(runs["hand"], runs["sailfin"])]
    print(f"hand / sailfin, CPU seconds after import torch (waiting for a busy CPU not "
          f"counted; disk waits neither): {spread(cpu)}")
    for name in runs:
        print(f"{name}: where the time goes (median per run):")
        for phase, seconds, calls in breakdown(runs[name]):
            each = (f" ({calls} x {seconds / calls * 1e3:.1f} ms)"
                    if calls > 1 and phase in ("epoch", "epoch-end save") else "")
            print(f"  {phase:>32}: {seconds * 1e3:8.1f} ms{each}")
    hand_epoch = statistics.median(sum(r["phases"]["epoch"]) for r in runs["hand"])
    sail = runs["sailfin"]
    sail_epoch = statistics.median(sum(r["phases"]["epoch"]) for r in sail)
    fixed = statistics.median(r["seconds"] - sum(r["phases"]["epoch"]) for r in sail)
    hand_fixed = statistics.median(r["seconds"] - sum(r["phases"]["epoch"])
                                   for r in runs["hand"])
    print(f"fixed costs (all but the epochs): sailfin {fixed * 1e3:.0f} ms, hand "
          f"{hand_fixed * 1e3:.0f} ms; the epochs: sailfin {sail_epoch * 1e3:.0f} ms, hand "
          f"{hand_epoch * 1e3:.0f} ms")
    summary("short_run.py", f"hand / sailfin wall time, {opts.epochs} x {opts.steps} steps, "
            "defaults, after import torch (per-round)", ratio, load, 1,
            extra=f"against a hand loop that also spares the GC {statistics.median(spared):.3f}; "
                  f"from process start {statistics.median(wall):.3f}; CPU seconds "
                  f"{statistics.median(cpu):.3f}")


if __name__ == "__main__":
    main()
