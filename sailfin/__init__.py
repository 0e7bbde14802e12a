"""sailfin: a lightweight PyTorch training library.

Write a recipe once (a ModuleInterface, a DataInterface, a YAML config) and
run it on a CPU, a GPU, with mixed precision, or over many processes.

``import sailfin`` stays light: torch (and the config schema) is imported when a
name that needs it is first touched (``sailfin.Trainer``), not before.
"""

from __future__ import annotations

import sys


def _stop_while_starting(signum: int, frame: object) -> None:
    """The sailfin command's first handler of SIGTERM and Ctrl-C, until it imports
    :mod:`sailfin.signals`: one line and exit 75. Nothing has begun to clean up, so it
    ends the process itself (an exception could meet a bare ``except:`` and be lost)."""
    import os
    import signal

    who = "sailfin launch" if sys.argv[1:2] == ["launch"] else "sailfin"
    os.write(2, f"{who}: stopped by {signal.Signals(signum).name} while starting, before "
             "any work began: nothing was lost; run the same command again (exit code 75)\n"
             .encode())
    os._exit(75)


def _catch_stops_while_starting() -> None:
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stop_while_starting)


def _run_as_the_command() -> bool:
    """``python -m sailfin``: Python imports this package first, with ``sys.argv[0]`` "-m"
    and ``sailfin`` after the interpreter's first ``-m`` (not a package that a module run
    with ``-m`` imports, not ``torchrun ... -m sailfin``'s agent)."""
    if sys.argv[:1] != ["-m"]:
        return False
    options = getattr(sys, "orig_argv", [])[1:]
    first = next((i for i, arg in enumerate(options) if arg.startswith("-m")), None)
    if first is None:
        return False
    module = options[first][2:] or (options[first + 1] if first + 1 < len(options) else "")
    return module == "sailfin"


if _run_as_the_command():  # before anything else: a stop while it imports is one line
    _catch_stops_while_starting()

import importlib  # noqa: E402

from .version import __version__  # noqa: E402

# Not ``from typing import ...``: the console script imports this package before its
# first handler (sailfin.__main__.run), and typing is most of what it would cost.
TYPE_CHECKING = False  # type checkers read it as typing.TYPE_CHECKING (True)
if TYPE_CHECKING:
    from typing import Any

# Imported when first touched, so that ``python -m sailfin`` reaches its first instruction
# (SIGTERM and Ctrl-C handled: sailfin.signals.stop_at_start) in milliseconds.
_LAZY = {
    "ConfigError": "sailfin.config",
    "RunConfig": "sailfin.config",
    "TrainerArguments": "sailfin.config",
    "load_config": "sailfin.config",
    "Trainer": "sailfin.trainer",
    "Callback": "sailfin.trainer",
    "Checkpointer": "sailfin.checkpoint",
    "DataInterface": "sailfin.interfaces",
    "DataProcessor": "sailfin.interfaces",
    "ModuleInterface": "sailfin.interfaces",
    "DistEnv": "sailfin.distributed",
    "BatchPlan": "sailfin.data",
    "seed_everything": "sailfin.utils.seed",
    "sharded_build": "sailfin.backends.fsdp_build",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sailfin' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted(__all__)
