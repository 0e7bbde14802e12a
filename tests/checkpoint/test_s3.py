"""Checkpoints on a real S3-compatible server (moto's server mode on 127.0.0.1)."""

import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from sailfin import Trainer
from tests.checkpoint.helpers import Crash, CrashAt, assert_same_params, metric_lines, params
from tests.recipes import IdData, LinearRecipe, args

pytest.importorskip("s3fs", reason="the remote checkpoint test needs sailfin[remote]")
pytest.importorskip("moto", reason="the S3 test server needs moto[server] (the dev extra)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def s3_server(tmp_path):
    """A moto S3 server on a free local port, stopped (its whole process group) after."""
    port = free_port()
    log = open(tmp_path / "moto.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                             "-p", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto server did not start: "
                                       + (tmp_path / "moto.log").read_text())
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        log.close()


def train(tmp, checkpoint, crash_at=None):
    module = LinearRecipe(IdData(40, 6), dropout=0.2, momentum=0.9)
    trainer = Trainer(module, args(tmp, epochs=2, checkpoint=checkpoint),
                      callbacks=[CrashAt(crash_at)] if crash_at else [])
    try:
        trainer.train()
    except Crash:
        pass
    return module, trainer


def test_s3_round_trip(tmp_path, s3_server):
    import s3fs

    # No credentials or region from the environment: everything the client needs is here.
    options = {"key": "testing", "secret": "testing", "skip_instance_cache": True,
               "client_kwargs": {"endpoint_url": s3_server, "region_name": "eu-west-1"}}
    fs = s3fs.S3FileSystem(**options)
    bucket = f"sailfin-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    url = f"s3://{bucket}/runs/one"
    ckpt = {"every_n_steps": 2, "at_epoch_end": False, "keep_last": 2, "async_save": True,
            "dir": url, "storage_options": options}
    ref, _ = train(tmp_path / "ref", {"every_n_steps": 2, "at_epoch_end": False})
    train(tmp_path / "run", ckpt, crash_at=7)
    fs.invalidate_cache()
    listed = sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{bucket}/runs/one"))
    assert listed == ["latest", "step-00000004", "step-00000006"]
    assert fs.cat(f"{bucket}/runs/one/latest").decode().strip() == "step-00000006"
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{bucket}/runs/one/step-00000006")) == [
        "manifest.json", "shards"]  # the small state is in the shards
    module, trainer = train(tmp_path / "run", ckpt)
    assert trainer.resumed_from.location == f"s3://{bucket}/runs/one/step-00000006"
    assert_same_params(params(ref), params(module))
    assert metric_lines(tmp_path / "run") == metric_lines(tmp_path / "ref")
