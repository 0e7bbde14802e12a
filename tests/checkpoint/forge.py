"""Forged checkpoint files: each names a callable that would create ``marker`` if it were
unpickled, and the manifest is updated to match (sizes, CRC-32s, its own checksum), as
whoever hands out a checkpoint can do. Loading one must refuse it without running it."""

from __future__ import annotations

import io
import json
import pickle
import zlib
from pathlib import Path

import torch

from sailfin.checkpoint.manifest import seal


class Payload:
    """Unpickled, it opens ``marker`` for writing: the file appears."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def refile(step: Path, relative: str) -> None:
    """Record ``step/relative``'s size and CRC-32 in the manifest, and reseal it."""
    data = (step / relative).read_bytes()
    entry = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    body = json.loads((step / "manifest.json").read_text())
    if relative.startswith("shards/"):
        body["sharded"]["files"][relative[len("shards/"):]] = entry
    else:
        body["files"][relative] = entry
    (step / "manifest.json").write_bytes(seal(body))


def forge_metadata(step: Path, marker: Path) -> Path:
    """DCP's index, a real one, with the payload among its planner data."""
    path = step / "shards" / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # the test's own file: trusted here
    metadata.planner_data = {"payload": Payload(marker)}
    path.write_bytes(pickle.dumps(metadata))
    refile(step, "shards/.metadata")
    return path


def forge_trainer_pt(step: Path, marker: Path) -> Path:
    """trainer.pt holding the payload beside the trainer's state."""
    path = step / "trainer.pt"
    state = torch.load(path, weights_only=True)
    state["module_state"] = {"payload": Payload(marker)}
    torch.save(state, path)
    refile(step, "trainer.pt")
    return path


def forge_shard_entry(step: Path, marker: Path) -> Path:
    """The shards written again by DCP, one small (bytes) entry the payload: the
    optimizer's learning rate."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    shards = step / "shards"
    whole = step / "whole.pt"
    dcp_to_torch_save(str(shards), str(whole))
    state = torch.load(whole, weights_only=False)  # the test's own file: trusted here
    whole.unlink()
    state["optimizers"]["0"]["param_groups"][0]["lr"] = Payload(marker)
    for file in shards.iterdir():
        file.unlink()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(shards), single_file_per_rank=True))
    body = json.loads((step / "manifest.json").read_text())
    body["sharded"]["files"] = {}
    (step / "manifest.json").write_bytes(seal(body))
    for file in sorted(shards.iterdir()):
        refile(step, f"shards/{file.name}")
    return shards
