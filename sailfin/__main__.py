"""``python -m sailfin`` and the ``sailfin`` console script: the sailfin command, a process
of its own.

Its first instruction makes SIGTERM and Ctrl-C a stop (under ``python -m sailfin`` the
package's own first lines already did, see ``sailfin/__init__.py``): while the command
imports its modules a stop is one line and exit code 75, not a ``KeyboardInterrupt``
traceback, a bare -15, or a Ctrl-C that an import swallowed while the run went on.
:func:`sailfin.cli.command` then takes the signals over.
"""

import sys

from . import _catch_stops_while_starting


def run() -> int:
    """The console script's entry point (``pyproject.toml``: ``sailfin.__main__:run``)."""
    _catch_stops_while_starting()
    from .cli import command  # after the handlers: a stop while it imports

    return command()


if __name__ == "__main__":
    sys.exit(run())
