"""``python -m sailfin``: the sailfin command, a process of its own.

Its first instruction makes SIGTERM and Ctrl-C a stop: while the command still imports
(sailfin, then torch) a stop is one line and exit code 75, not a ``KeyboardInterrupt``
traceback or a bare -15; :func:`sailfin.cli.command` then takes the signals over.
"""

import signal
import sys


class _Stopped(BaseException):
    pass


def _stop(signum, frame):
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # copies of the same stop, while it unwinds
    raise _Stopped(signal.Signals(signum).name)


for _sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_sig, _stop)

try:
    from .cli import command
except _Stopped as stop:
    who = "sailfin launch" if sys.argv[1:2] == ["launch"] else "sailfin"
    print(f"{who}: stopped by {stop.args[0]} while starting, before any work began: nothing "
          "was lost; run the same command again (exit code 75)", file=sys.stderr, flush=True)
    sys.exit(75)
sys.exit(command())
