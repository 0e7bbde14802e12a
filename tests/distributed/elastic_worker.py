"""A torchrun worker: joins the group through sailfin's store, then all-reduces
until told to stop. Rank 1 of attempts 0 and 1 is killed by the test."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from sailfin.distributed.process_group import torchrun_store

out_dir = sys.argv[1]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
timeout = datetime.timedelta(seconds=30)
store = torchrun_store(os.environ, rank, world, timeout)
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
with open(os.path.join(out_dir, f"pid-{attempt}-{rank}"), "w") as fh:
    fh.write(str(os.getpid()))
x = torch.ones(1)
for _ in range(400 if attempt < 2 else 5):  # attempts 0 and 1 run until killed
    dist.all_reduce(x)
    time.sleep(0.02)
assert x.item() == world ** (400 if attempt < 2 else 5)
dist.destroy_process_group()
with open(os.path.join(out_dir, f"done-{rank}"), "w") as fh:
    fh.write(str(attempt))
