"""One thread count for the CPU math of a whole run: MKL's dynamic choice off (it may run
on fewer threads than asked), and a word when OpenMP's own (OMP_DYNAMIC) is on."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# In a process of its own: the test process may have called torch.set_num_threads already.
PROBE = """
import ctypes, os, sys, tempfile
import torch
lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
dynamic = lib.mkl_serv_get_dynamic  # MKL's own flag, read where torch linked MKL
before = dynamic()
from sailfin import Trainer
from tests.recipes import IdData, LinearRecipe, args
trainer = Trainer(LinearRecipe(IdData(20, 0)), args(tempfile.mkdtemp(), progress="none"))
trainer.setup()
print(before, dynamic(), torch.get_num_threads())
trainer.close()
"""


def _probe(env=None):
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.pop("MKL_DYNAMIC", None)
    return subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_set_up_turns_mkls_dynamic_thread_count_off():
    """Four runs of one config gave identical weights, a fifth on a busy machine differed
    from step 2: MKL may pick its thread count per call (MKL_DYNAMIC, on by default)."""
    if not torch.backends.mkl.is_available():
        pytest.skip("torch is built without MKL")
    proc = _probe()
    if "mkl_serv_get_dynamic" in proc.stderr:
        pytest.skip("this MKL build does not export its dynamic flag")
    assert proc.returncode == 0, proc.stderr
    before, after, threads = map(int, proc.stdout.split()[-3:])
    assert (before, after) == (1, 0), proc.stdout  # on by default, off from set-up on
    assert threads >= 1


def test_omp_dynamic_on_is_said_once_at_set_up():
    proc = _probe({"OMP_DYNAMIC": "true"})
    if proc.returncode != 0 and "mkl_serv_get_dynamic" in proc.stderr:
        pytest.skip("this MKL build does not export its dynamic flag")
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "OMP_DYNAMIC" in line]
    assert len(said) == 1 and "unset OMP_DYNAMIC" in said[0], proc.stderr
