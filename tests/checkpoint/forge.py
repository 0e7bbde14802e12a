"""Forged checkpoint files: each names a callable that would create ``marker`` if it were
unpickled, and the manifest is updated to match (sizes, CRC-32s, its own checksum), as
whoever hands out a checkpoint can do. Loading one must refuse it without running it."""

from __future__ import annotations

import io
import json
import pickle
import warnings
import zlib
from pathlib import Path

import torch

from sailfin.checkpoint.manifest import seal


# What a refusal names: pickle records ``open`` under its module (io, or _io on 3.13).
NEEDS = f"{open.__module__}.open"


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


def small_entries(state: dict) -> list[str]:
    """sailfin's small entries among what ``dcp_to_torch_save`` gives (the trainer's
    state, each rank's random streams)."""
    return [key for key in state if key == "trainer" or key.startswith("rng/")]


def rewrite_shards(step: Path, change) -> Path:
    """The shards written again by DCP after ``change(state)`` (state: what
    ``dcp_to_torch_save`` gives; a small entry given as ``bytes`` is written as they
    are), the manifest's file and entry checksums updated to match."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    class AsGiven(DefaultSavePlanner):  # a BytesIO entry: these bytes, as sailfin writes
        def transform_object(self, write_item, object):
            if isinstance(object, io.BytesIO):
                return object
            return super().transform_object(write_item, object)

    shards = step / "shards"
    whole = step / "whole.pt"
    dcp_to_torch_save(str(shards), str(whole))
    state = torch.load(whole, weights_only=False)  # the test's own file: trusted here
    whole.unlink()
    change(state)
    entries = {}
    for key in small_entries(state):
        data = state[key]
        if not isinstance(data, bytes):
            buffer = io.BytesIO()
            torch.save(data, buffer)
            data = buffer.getvalue()
        state[key] = io.BytesIO(data)
        entries[key] = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}",
                        "file": "__0_0.distcp"}  # one process writes one file
    for file in shards.iterdir():
        file.unlink()
    with warnings.catch_warnings():  # DCP warns that one process saves: it is meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(shards),
                                                            single_file_per_rank=True),
                 planner=AsGiven(), no_dist=True)
    body = json.loads((step / "manifest.json").read_text())
    body["sharded"]["files"] = {}
    body["sharded"]["entries"] = entries
    (step / "manifest.json").write_bytes(seal(body))
    for file in sorted(shards.iterdir()):
        refile(step, f"shards/{file.name}")
    return shards / "__0_0.distcp"


def forge_trainer_entry(step: Path, marker: Path) -> Path:
    """The trainer's small entry holding the payload beside the trainer's state."""
    def change(state):
        state["trainer"]["module_state"] = {"payload": Payload(marker)}
    return rewrite_shards(step, change)


def forge_shard_entry(step: Path, marker: Path) -> Path:
    """The shards written again by DCP, one small (bytes) entry of the optimizers the
    payload: the learning rate."""
    def change(state):
        state["optimizers"]["0"]["param_groups"][0]["lr"] = Payload(marker)
    rewrite_shards(step, change)
    return step / "shards"
