"""sailfin's one voice: every line it writes for the person reading the job's output.

Notices and warnings go through :func:`say`, metrics through the writers
(``sailfin.logging``), a command's result to stdout and the error it ends on through
:func:`line`; Python's ``warnings`` only for something in the user's own code or a
category the user may filter (``NonFiniteLossWarning``). Each line is a record of the
``sailfin`` logger (an application's logging, a test's ``caplog`` sees it), which sailfin's
own handler also writes to the ``sys.stderr`` of the moment: ``sailfin: <message>`` on
rank 0, ``sailfin[rank 3]: <message>`` (warnings only) elsewhere, and nothing when the
root logger already prints to the terminal, so no line shows twice.

Example::

    from sailfin.utils.voice import say
    say("trainer.ema: the checkpoint holds no average; it starts from the resumed weights")
    say("shard-000001.tar: truncated; skipped sample (2 so far)", warning=True)
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("sailfin")


def say(message: str, *, warning: bool = False) -> None:
    """Tell the person running the job ``message`` (one line, flushed); ``warning``:
    something they should act on, shown on every rank."""
    log.log(logging.WARNING if warning else logging.INFO, message)


def line(text: str) -> None:
    """Write ``text`` to stderr as it is, flushed: a command's last word (the error it
    ends on), which the command itself says on the right rank."""
    print(text, file=sys.stderr, flush=True)


def configure(rank: int = 0) -> None:
    """This process is ``rank``: rank 0 shows notices and warnings, the others only
    warnings, each line prefixed with its rank."""
    _HANDLER.setFormatter(logging.Formatter(
        "sailfin: %(message)s" if rank == 0 else f"sailfin[rank {rank}]: %(message)s"))
    _HANDLER.setLevel(logging.INFO if rank == 0 else logging.WARNING)


class _Terminal(logging.StreamHandler):
    """The ``sys.stderr`` of the moment (a test's capture, a notebook's cell), unless the
    application's root logger prints to the terminal itself."""

    def emit(self, record: logging.LogRecord) -> None:
        terminal = (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)
        if not any(isinstance(h, logging.StreamHandler) and getattr(h, "stream", None)
                   in terminal for h in logging.getLogger().handlers):
            self.stream = sys.stderr  # not setStream: it flushes the old one, maybe closed
            super().emit(record)  # flushed; a closed stream does not end the run


_HANDLER = _Terminal()
configure(0)
log.addHandler(_HANDLER)
if log.level == logging.NOTSET:
    log.setLevel(logging.INFO)  # notices reach the handler; the root's WARNING would stop them
