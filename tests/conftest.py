import os
import time

import pytest
import torch  # noqa: F401  (torch sets a few variables of its own at import)


@pytest.fixture(autouse=True)
def _no_leaked_env():
    """Fail a test that leaves environment variables behind (rank variables above all)."""
    before = dict(os.environ)
    yield
    after = dict(os.environ)
    leaked = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    # torch's compiler caches set their own directory variables lazily, and a CUDA build's
    # first CUDA initialisation (torch.compile asks for devices) sets CUDA_MODULE_LOADING.
    leaked = {k for k in leaked if k not in ("PYTEST_CURRENT_TEST", "CUDA_MODULE_LOADING")
              and not k.startswith(("TORCHINDUCTOR_", "_TORCHINDUCTOR_", "TRITON_"))}
    assert not leaked, f"test changed environment variables: {sorted(leaked)}"


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("test left a torch.distributed process group initialised")


# --compat-subset (make test-compat-ci): these directories' default suites whole, one test
# of every other file of the default suite, and the first test of each of these slow files
# (a kill and resume, 2-process ddp and fsdp, memory snapshots, 2-process dp).
WHOLE = ("backends", "checkpoint", "distributed")
SLOW_SCENARIOS = ("tests/checkpoint/test_kill.py", "tests/checkpoint/test_memory_kill.py",
                  "tests/distributed/test_ddp.py", "tests/distributed/test_fsdp.py",
                  "tests/distributed/test_memory_snapshots.py", "tests/dp/test_dp_processes.py")


def pytest_addoption(parser):
    parser.addoption("--compat-subset", action="store_true",
                     help="the subset CI runs at both ends of the supported versions")


def compat_subset(items: list) -> tuple[list, list]:
    """(kept, deselected): see WHOLE and SLOW_SCENARIOS."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    kept, deselected, files = [], [], set()
    for item in items:
        path = os.path.relpath(str(item.path), root).replace(os.sep, "/")
        slow = "slow" in item.keywords
        whole = path.split("/")[1] in WHOLE and not slow
        first = path not in files and (not slow or path in SLOW_SCENARIOS)
        (kept if whole or first else deselected).append(item)
        if first:
            files.add(path)
    return kept, deselected


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.cuda`` tests skip, saying why, where there is no CUDA device;
    ``--compat-subset`` keeps what :func:`compat_subset` keeps."""
    if config.getoption("--compat-subset"):
        kept, deselected = compat_subset(items)
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none here); run `make test-gpu` on "
                                   "a machine with one")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_leaked_signal_handlers_or_threads():
    """Fail a test that leaves a signal handler, the wakeup fd or a sailfin thread (the hang
    watchdog, the set-up stop watcher) behind: sailfin used in-process must leave its host
    as it found it, and a thread left running could end the test run (exit 75)."""
    import signal
    import threading

    watched = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
    before = {sig: signal.getsignal(sig) for sig in watched}
    yield
    changed = [signal.Signals(sig).name for sig in watched if signal.getsignal(sig) != before[sig]]
    for sig in watched:  # put them back so that one leak fails one test, not the rest
        signal.signal(sig, before[sig])
    wakeup = signal.set_wakeup_fd(-1)
    deadline = time.monotonic() + 5  # a thread told to stop may take a moment to leave
    while True:
        alive = [t.name for t in threading.enumerate()
                 if t.name.startswith("sailfin-") and t.is_alive()]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not changed, f"test left signal handler(s) changed: {changed}"
    assert wakeup == -1, "test left a signal wakeup fd set"
    assert not alive, f"test left sailfin thread(s) running: {alive}"
