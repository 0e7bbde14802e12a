"""``python -m sailfin``: the sailfin command, a process of its own.

Its first instruction makes SIGTERM and Ctrl-C a stop: while the command imports its
own modules a stop is one line and exit code 75, not a ``KeyboardInterrupt`` traceback
or a bare -15. Nothing has begun to clean up, so the handler ends the process itself
(an exception could meet a bare ``except:``); :func:`sailfin.cli.command` then takes
the signals over.
"""

import os
import signal
import sys


def _stop(signum, frame):
    who = "sailfin launch" if sys.argv[1:2] == ["launch"] else "sailfin"
    os.write(2, f"{who}: stopped by {signal.Signals(signum).name} while starting, before "
             "any work began: nothing was lost; run the same command again (exit code 75)\n"
             .encode())
    os._exit(75)


for _sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_sig, _stop)

from .cli import command  # noqa: E402  (after the handlers: a stop while it imports)

sys.exit(command())
