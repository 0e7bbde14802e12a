"""A recipe for the elastic tests and benchmark: it records, per process, which sample
ids every optimizer step trained on and when, and writes its pid, so a test can kill
it mid-run and check afterwards that no sample was skipped or seen twice."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tests.recipes import LinearRecipe


def attempt_key() -> str:
    """One rendezvous round: torchrun's restart count and the world size."""
    return (f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', 'none')}"
            f"-w{os.environ.get('WORLD_SIZE', '1')}")


class ElasticRecipe(LinearRecipe):
    def __init__(self, data, out: str, step_seconds: float = 0.0, **kw) -> None:
        super().__init__(data, **kw)
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.step_seconds = step_seconds
        rank = os.environ.get("RANK", "0")
        self.tag = f"rank{rank}-{attempt_key()}-pid{os.getpid()}"
        (self.out / f"pid-{self.tag}").write_text(str(os.getpid()))
        self._log = open(self.out / f"steps-{self.tag}.jsonl", "a", buffering=1)

    def train_step(self, global_step, batch, device):
        if self.step_seconds:
            time.sleep(self.step_seconds)
        return super().train_step(global_step, batch, device)

    def on_end_train_step(self, global_step, loss, stats):
        super().on_end_train_step(global_step, loss, stats)
        self._log.write(json.dumps({"step": global_step, "ids": self.step_ids[-1],
                                    "time": time.time(), "attempt": attempt_key()}) + "\n")
