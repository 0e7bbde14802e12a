"""Time to the first step on the digits demo: imports, building the recipe, ``Trainer.setup``
and the first optimizer step, each in a fresh process (what ``make demo`` pays).

Most of ``setup`` on a CPU is not sailfin's: the first optimizer PyTorch builds
imports ``torch._dynamo`` (its ``__init__`` is wrapped by ``_disable_dynamo``),
about a second. Each round therefore runs two fresh processes: one as a
user's would, and one that imports ``torch._dynamo`` before the clock starts,
so what is left of ``setup`` is sailfin's own work (directory checks, seeding,
plan, loaders, writers). Every clock starts after the imports; the figure is
the median over rounds.

    python benchmarks/startup.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _measure import add_load_options, interleave, spread, start, summary  # noqa: E402

CHILD = r"""
import json, sys, tempfile, time
t0 = time.perf_counter()
import torch
torch.set_num_threads(1)
if sys.argv[1] == "pre":
    import torch._dynamo  # noqa: F401  (torch's lazy import, paid before the clock)
from sailfin import Callback, Trainer, TrainerArguments
from examples.digits.recipe import DigitsClassifier, DigitsData

class FirstStep(Callback):
    at = None
    def on_step_end(self, trainer):
        self.at = time.perf_counter()
        raise KeyboardInterrupt

t1 = time.perf_counter()
module = DigitsClassifier(DigitsData(val_fraction=0.2), hidden=128, lr=0.003)
args = TrainerArguments(output_dir=tempfile.mkdtemp(), epochs=1, train_batch_size=64,
                        micro_batch_size=64, log_every_n_steps=20, writers=["stdout", "jsonl"],
                        checkpoint={"best_metric": "accuracy", "best_mode": "max"})
first = FirstStep()
trainer = Trainer(module, args, callbacks=[first])
t2 = time.perf_counter()
trainer.setup()
t3 = time.perf_counter()
try:
    trainer.train()
except KeyboardInterrupt:
    pass
print(json.dumps({"imports": t1 - t0, "build": t2 - t1, "setup": t3 - t2,
                  "first_step": first.at - t3}))
"""


def child(mode: str) -> dict:
    root = os.path.dirname(HERE)
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", CHILD, mode], cwd=root, env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    add_load_options(parser)
    opts = parser.parse_args()
    load = start(opts, "startup.py")
    runs: dict[str, list[dict]] = {"plain": [], "pre": []}

    def variant(mode):
        def run(i):
            runs[mode].append(child(mode))
            return runs[mode][-1]["setup"]
        return run

    interleave(opts.rounds, {"plain": variant("plain"), "pre": variant("pre")}, warmup=0)
    for mode, label in (("plain", "as a user runs it"),
                        ("pre", "torch._dynamo imported before the clock")):
        ms = {k: statistics.median(r[k] for r in runs[mode]) * 1000 for k in runs[mode][0]}
        print(f"{label:>40}: imports {ms['imports']:.0f} ms, building the recipe "
              f"{ms['build']:.0f} ms, Trainer.setup {ms['setup']:.1f} ms, first step "
              f"{ms['first_step']:.1f} ms")
    own = [r["setup"] * 1000 for r in runs["pre"]]
    share = [p["setup"] / q["setup"] for p, q in zip(runs["pre"], runs["plain"])]
    print(f"sailfin's own share of Trainer.setup, per round: {spread(share)}")
    summary("startup.py", "Trainer.setup without torch's lazy import, ms", own, load, 1,
            extra=f"with it {statistics.median(r['setup'] for r in runs['plain']) * 1000:.0f}"
                  f" ms; first step "
                  f"{statistics.median(r['first_step'] for r in runs['plain']) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
