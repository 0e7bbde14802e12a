"""sailfin's one voice: every line it writes for the person reading the job's output.

Notices (a feature chose something, a run resumed, a lock was taken over) and warnings
(a bad sample skipped, a non-finite loss) go through :func:`say`. Metrics go through the
writers (``sailfin.logging``); a command's own result (``sailfin train``'s closing
summary, ``--print-config``) goes to stdout, and the error a command ends on is its
:func:`line`. Python's ``warnings`` are kept for what
they are for: something in the user's own code (a loader with ``persistent_workers``
and ``set_epoch``), and a category the user may filter or turn into an error
(``NonFiniteLossWarning`` under ``trainer.on_nonfinite: warn``).

Each line is a record of the ``sailfin`` logger, so an application (or a test's
``caplog``) that routes logging sees every one, and is also written by sailfin's own
handler to ``sys.stderr`` as it is at that moment, flushed: ``sailfin: <message>`` on
rank 0, ``sailfin[rank 3]: <message>`` elsewhere, where only warnings are shown (one
line per job, not one per rank). When the application's root logger already prints to
the terminal, sailfin's handler stays quiet, so no line shows twice.

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


class _Terminal(logging.Handler):
    """Writes each record to the ``sys.stderr`` of the moment (a test's capture, a
    notebook's cell) and flushes it, unless the root logger prints it already."""

    def emit(self, record: logging.LogRecord) -> None:
        if _root_prints():
            return
        try:
            stream = sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # a closed stream must not end the run
            self.handleError(record)


def _root_prints() -> bool:
    """Whether the application's root logger writes records to the terminal itself."""
    return any(isinstance(h, logging.StreamHandler)
               and getattr(h, "stream", None) in (sys.stderr, sys.stdout, sys.__stderr__,
                                                  sys.__stdout__)
               for h in logging.getLogger().handlers)


_HANDLER = _Terminal()
configure(0)
log.addHandler(_HANDLER)
if log.level == logging.NOTSET:
    log.setLevel(logging.INFO)  # notices reach the handler; the root's WARNING would stop them
