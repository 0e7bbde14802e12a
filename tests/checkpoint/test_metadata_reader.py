"""DCP's index (``shards/.metadata``) is read by an unpickler that allows only DCP's
metadata classes and plain types: what this torch and this Python write reads back
(Python 3.13 pickles a path as ``pathlib._local.PosixPath``), anything else is refused."""

import io
import os
import pathlib
import pickle
import warnings

import pytest
import torch

from sailfin.compat.torch import read_dcp_metadata


def test_the_index_this_torch_writes_is_read(tmp_path):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # one process, no process group: meant
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(3), "n": io.BytesIO(b"x")}, checkpoint_id=tmp_path)
    with open(tmp_path / ".metadata", "rb") as fh:
        metadata = read_dcp_metadata(fh)
    assert {"w", "n"} <= set(metadata.state_dict_metadata)


def test_a_path_as_this_python_pickles_it_is_allowed():
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    where = pathlib.Path("/checkpoints/step-00000002/shards")
    blob = pickle.dumps(Metadata(state_dict_metadata={},
                                 storage_meta=StorageMeta(checkpoint_id=where)))
    assert read_dcp_metadata(io.BytesIO(blob)).storage_meta.checkpoint_id == where


def test_a_callable_is_refused_before_it_runs(tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    with pytest.raises(pickle.UnpicklingError, match=r"names posix\.mkdir"):
        read_dcp_metadata(io.BytesIO(pickle.dumps(Payload())))
    assert not marker.exists()
