"""The rendezvous store for workers started by torchrun, safe across restarts.

Under torchrun (c10d rendezvous) the agent hosts a TCPStore that outlives its
workers, and ``init_process_group("env://")`` writes every attempt's keys
(each rank's gloo address, among others) under the same names. After torchrun
restarts the workers, a fast rank can read a key its slower peer has not yet
rewritten and dial the dead worker's port: gloo's ``connectFullMesh`` fails
with "Connection refused", or a rank waits for a peer that is looking
elsewhere until the timeout. Measured with torchrun 2.13 on loopback, killing
one of two workers twice per run: 3 of 3 runs with env:// failed or hung,
4 of 4 with a per-attempt namespace finished.

So sailfin joins the agent's store itself and gives each attempt its own key
namespace: ``sailfin/<run id>/attempt-<restart count>-world-<world size>``.
"""

from __future__ import annotations

import datetime
from typing import Mapping

import torch.distributed as dist


def attempt_prefix(environ: Mapping[str, str]) -> str:
    """The key namespace of this rendezvous round of this torchrun job.

    torchrun counts restarts after failures (TORCHELASTIC_RESTART_COUNT) but
    not the new rounds it starts when a node joins; those change the world
    size instead. Within one restart count the world only grows, so the pair
    names every round once.
    """
    run_id = environ.get("TORCHELASTIC_RUN_ID", "none")
    restart = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    world = environ.get("WORLD_SIZE", "0")
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "False":
        # Rank 0 hosts a fresh store every round (no stale keys), and the restart count
        # differs between nodes: an agent whose own workers did not fail does not count
        # the round its partner's failure started. One name for all of them.
        return f"sailfin/{run_id}/port-{environ.get('MASTER_PORT', '0')}-world-{world}"
    return f"sailfin/{run_id}/attempt-{restart}-world-{world}"


def torchrun_store(environ: Mapping[str, str], rank: int, world_size: int,
                   timeout: datetime.timedelta) -> dist.Store:
    """A store for ``init_process_group(store=...)`` under torchrun.

    When the agent shares its store (``TORCHELASTIC_USE_AGENT_STORE=True``, the
    default), every rank is a client; otherwise rank 0 hosts it, as env:// does.
    """
    try:
        host, port = environ["MASTER_ADDR"], int(environ["MASTER_PORT"])
    except (KeyError, ValueError):
        raise RuntimeError("torchrun did not set MASTER_ADDR/MASTER_PORT; start the job with "
                           "torchrun, or set trainer.distributed for another launcher") from None
    agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world_size, is_master=not agent_store and rank == 0,
                          timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore(attempt_prefix(environ), store)
