import os

import pytest
import torch  # noqa: F401  (torch sets a few variables of its own at import)


@pytest.fixture(autouse=True)
def _no_leaked_env():
    """Fail a test that leaves environment variables behind (rank variables above all)."""
    before = dict(os.environ)
    yield
    after = dict(os.environ)
    leaked = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    # torch's compiler caches set their own directory variables lazily.
    leaked = {k for k in leaked if k != "PYTEST_CURRENT_TEST"
              and not k.startswith(("TORCHINDUCTOR_", "_TORCHINDUCTOR_", "TRITON_"))}
    assert not leaked, f"test changed environment variables: {sorted(leaked)}"


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("test left a torch.distributed process group initialised")


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.cuda`` tests skip, saying why, where there is no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none here); run `make test-gpu` on "
                                   "a machine with one")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
