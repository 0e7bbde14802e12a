"""Rank 0's view of a run: a progress bar in a terminal, plain lines elsewhere, and a
short summary at the end. It shows the values the trainer logs, never reading a tensor."""

from __future__ import annotations

import io
import os
import sys
import time
from typing import IO, TYPE_CHECKING, Any, Optional

from ...logging.stdout import flop_rate, format_value
from ...logging.writers import Writer
from ..core.callbacks import Callback

if TYPE_CHECKING:
    from ..core.view import RunView

BAR_REDRAW_SECONDS = 0.5
# tqdm's layout without its steps/s (samples/s in the postfix says more); ETA = remaining.
BAR_FORMAT = "{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"
# The bar keeps this many columns; the values after it are dropped (least needed first)
# until the line fits the terminal, never cut. SLACK: the clocks may grow a digit or two
# before the values are fitted again.
MIN_BAR_COLUMNS = 10
SLACK_COLUMNS = 4
# The values are fitted again (tqdm's layout, up to 7 times: a logged event's largest
# cost) when the terminal's width changes, their text grows past the last fit's, or after
# this long (the clocks grow); else the last fit's choice stands.
REFIT_SECONDS = 10.0
_EMA = 0.3  # weight of the newest window in the moving averages


def resolve_mode(mode: str, stream: Optional[IO[str]] = None) -> str:
    """``auto`` -> ``bar`` when ``stream`` (stderr) is a terminal and tqdm is
    installed, else ``lines``; other modes are returned as they are."""
    if mode != "auto":
        return mode
    stream = stream if stream is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    if not (isatty and isatty()) or os.environ.get("TERM") == "dumb":
        return "lines"
    try:
        import tqdm  # noqa: F401
    except ModuleNotFoundError:
        return "lines"
    return "bar"


def human(value: Optional[float]) -> str:
    """12345.6 -> '12.3k'; None -> '-'."""
    if value is None:
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.1f}"


def terminal_width(stream: Any) -> int:
    """Columns of the terminal ``stream`` writes to; else ``COLUMNS``; else 80."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        columns = os.environ.get("COLUMNS", "")
        return int(columns) if columns.isdigit() and int(columns) > 0 else 80


def clock(seconds: Optional[float]) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def mebibytes(n: Optional[int]) -> str:
    return "?" if n is None else f"{n / 2**20:,.0f} MiB"


class Progress(Writer, Callback):
    """Step, epoch, loss, learning rate, samples/s (moving and run average), ETA.

    ``mode``: ``bar`` (tqdm on stderr), ``lines`` (a plain line on stdout every
    ``interval`` seconds, for logs and CI), or ``auto`` (bar when stderr is a terminal).
    The trainer builds one on rank 0 from ``trainer.progress``.

    Example::

        Trainer(module, args, callbacks=[Progress("lines", interval=5)]).train()
    """

    def __init__(self, mode: str = "auto", interval: float = 30.0,
                 bar_stream: Optional[IO[str]] = None,
                 line_stream: Optional[IO[str]] = None) -> None:
        self.mode = resolve_mode(mode, bar_stream)
        if self.mode not in ("bar", "lines"):
            raise ValueError(f"progress mode must be auto, bar or lines, got {mode!r}")
        if self.mode == "bar":
            try:
                import tqdm  # noqa: F401
            except ModuleNotFoundError:
                raise ModuleNotFoundError(
                    "trainer.progress: bar needs tqdm: pip install 'sailfin[progress]' "
                    "(or use progress: lines)") from None
        self.interval = interval
        self._bar_stream, self._line_stream = bar_stream, line_stream
        self._bar: Any = None
        self._trainer: Optional["RunView"] = None
        self._console = _AboveBar(self)
        self.loss: Optional[float] = None
        self.lr: Optional[float] = None
        self.samples_per_second: Optional[float] = None  # moving average
        self.tflops: Optional[float] = None  # model TFLOP/s per device, and its share of peak
        self.mfu: Optional[float] = None
        self.epsilon: Optional[float] = None  # privacy spent (the dp backends)
        self._step_rate: Optional[float] = None           # lines mode: steps/s, moving
        self._start = 0.0
        self._start_samples = 0
        self._start_train_seconds = 0.0
        self._epoch_started: Optional[float] = 0.0  # None: no epoch running (the loop ended)
        self._total = 0
        self._epochs = 1
        self._next_line = 0.0
        self._last_line = (0.0, 0)
        self._fit = (-1, 0, 0, 0.0)  # the bar's last fit: keep, width, text length, until

    # -- the stream the stdout writer prints to: above the bar, never through it --------
    def console(self) -> IO[str]:
        return self._console if self.mode == "bar" else self._lines()

    def _lines(self) -> IO[str]:
        return self._line_stream if self._line_stream is not None else sys.stdout

    # -- callback ---------------------------------------------------------------------
    def on_train_start(self, trainer: "RunView") -> None:
        args = trainer.args
        total = trainer.steps_per_epoch * args.epochs
        if args.max_steps is not None:
            total = min(total, args.max_steps)
        total = max(total, trainer.global_step)  # a resumed run already past its new end
        self._total, self._epochs = total, args.epochs
        self._start = time.perf_counter()
        self._start_samples = trainer.samples_seen
        self._start_train_seconds = trainer.train_seconds
        self._epoch_started = self._start
        self._trainer = trainer
        self._last_line = (self._start, trainer.global_step)
        self._next_line = self._start + self.interval
        if self.mode == "bar":
            from tqdm import tqdm

            stream = self._bar_stream if self._bar_stream is not None else sys.stderr
            self._bar = tqdm(
                total=total, initial=trainer.global_step, desc=self._epoch_text(trainer),
                file=stream, unit="step", ncols=terminal_width(stream),
                mininterval=BAR_REDRAW_SECONDS, smoothing=0.1, leave=True,
                bar_format=BAR_FORMAT)
        else:
            out = self._lines()
            out.write(f"[progress] training {total} steps ({args.epochs} epoch(s) of "
                      f"{trainer.steps_per_epoch}), global batch {args.train_batch_size}, "
                      f"world size {trainer.dist.world_size}"
                      + (f", from step {trainer.global_step}" if trainer.global_step else "")
                      + "\n")
            out.flush()

    def on_step_end(self, trainer: "RunView") -> None:
        # The hot path: one counter update (tqdm checks the clock only every few
        # steps), or one clock read in lines mode. No tensor is touched.
        if self._bar is not None:
            self._bar.update(1)
        else:
            now = time.perf_counter()
            if now >= self._next_line:
                self._next_line = now + self.interval
                self._print_line(trainer, now)

    def on_epoch_end(self, trainer: "RunView") -> None:
        self._epoch_started = time.perf_counter()
        if self._bar is not None:
            self._bar.set_description_str(self._epoch_text(trainer), refresh=False)
            self._bar.set_postfix_str(self._fitted_values(), refresh=False)

    def on_train_end(self, trainer: "RunView") -> None:
        summary = trainer.summary
        if summary and summary.get("nothing_trained"):  # said once, by the trainer
            self.close()
            return
        # The loop is over: trainer.train_seconds holds all of it, the last epoch's
        # time too (added when the epoch stopped, at max_steps inside it as at its end).
        self._epoch_started = None
        if self._bar is None:
            self._print_line(trainer, time.perf_counter())
        else:  # the bar's last values: the run's average as the summary gives it
            self._bar.set_postfix_str(self._fitted_values(), refresh=True)
        self.close()
        if summary:
            out = self._lines()
            out.write(summary_text(summary) + "\n")
            out.flush()

    # -- writer: the values the trainer logged anyway ----------------------------------
    def log_metrics(self, metrics, step, epoch, split):
        if split != "train":
            return
        self.loss = metrics.get("loss", self.loss)
        self.lr = metrics.get("lr", self.lr)
        self.tflops = metrics.get("tflops", self.tflops)
        self.mfu = metrics.get("mfu", self.mfu)
        self.epsilon = metrics.get("epsilon", self.epsilon)  # dp backends
        rate = metrics.get("samples_per_second")
        if rate is not None:
            self.samples_per_second = rate if self.samples_per_second is None else (
                _EMA * rate + (1 - _EMA) * self.samples_per_second)
        if self._bar is not None:
            self._bar.set_postfix_str(self._fitted_values(), refresh=False)

    def close(self) -> None:
        if self._bar is not None:  # training stopped by an error: leave the bar as it was
            self._bar.close()
            self._bar = None

    # -- text ---------------------------------------------------------------------------
    def _epoch_text(self, trainer: "RunView") -> str:
        return f"epoch {min(trainer.epoch + 1, self._epochs)}/{self._epochs}"

    def _average_rate(self, samples_seen: int, now: float) -> Optional[float]:
        """Samples per second of training time since the start (validation excluded,
        as in summary.json): the trainer's finished epochs plus this one so far (the
        trainer adds an epoch's time to ``train_seconds`` only when the epoch stops)."""
        trainer = self._trainer
        done = trainer.train_seconds - self._start_train_seconds if trainer is not None else 0.0
        running = 0.0 if self._epoch_started is None else now - self._epoch_started
        elapsed = done + running
        return (samples_seen - self._start_samples) / elapsed if elapsed > 0 else None

    def _value_parts(self, samples_seen: int, now: float) -> list[tuple[int, str]]:
        """(rank, text) in display order; the bar drops the highest ranks first. A text
        starting with a space belongs to the value before it."""
        parts = []
        if self.loss is not None:
            parts.append((0, f"loss {format_value(self.loss)}"))
        if self.lr is not None:
            parts.append((3, f"lr {self.lr:.2e}"))
        parts.append((1, f"{human(self.samples_per_second)} samples/s"))
        parts.append((5, f" (avg {human(self._average_rate(samples_seen, now))})"))
        if self.epsilon is not None:
            parts.append((2, f"ε {self.epsilon:.3g}"))
        if self.tflops is not None:
            parts.append((4, flop_rate(self.tflops)))
            if self.mfu is not None:
                parts.append((6, f" (MFU {100 * self.mfu:.1f}%)"))
        return parts

    def _values_text(self, samples_seen: int, now: float, keep: int = 99) -> str:
        text = ""
        for rank, part in self._value_parts(samples_seen, now):
            if rank <= keep:
                text += part if part.startswith(" ") or not text else ", " + part
        return text

    def _fitted_values(self) -> str:
        """The values that fit the terminal beside the bar (re-read: it may be resized;
        fitted again as :data:`REFIT_SECONDS` says)."""
        bar = self._bar
        width = terminal_width(bar.fp)
        samples_seen, now = self._trainer.samples_seen, time.perf_counter()
        keep, fitted_width, fitted_length, until = self._fit
        text = self._values_text(samples_seen, now, keep)
        if width == fitted_width and len(text) <= fitted_length and now < until:
            return text
        bar.ncols = width
        meter = dict(bar.format_dict, ncols=None, bar_format=BAR_FORMAT.replace("{bar}", ""))
        for keep in range(6, -2, -1):  # -1: no value fits
            text = self._values_text(samples_seen, now, keep)
            meter["postfix"] = text
            if keep < 0 or (len(bar.format_meter(**meter)) + MIN_BAR_COLUMNS + SLACK_COLUMNS
                            <= width):
                break
        self._fit = (keep, width, len(text), now + REFIT_SECONDS)
        return text

    def _print_line(self, trainer: "RunView", now: float) -> None:
        step = trainer.global_step
        then, then_step = self._last_line
        if now > then and step > then_step:
            rate = (step - then_step) / (now - then)
            self._step_rate = rate if self._step_rate is None else (
                _EMA * rate + (1 - _EMA) * self._step_rate)
        self._last_line = (now, step)
        left = self._total - step
        eta = 0.0 if left <= 0 else (left / self._step_rate if self._step_rate else None)
        pct = 100.0 * step / self._total if self._total else 100.0
        text = (f"[progress] step {step}/{self._total} ({pct:.0f}%) | "
                f"{self._epoch_text(trainer)} | {self._values_text(trainer.samples_seen, now)} | "
                f"elapsed {clock(now - self._start)} | ETA {clock(eta)}")
        out = self._lines()
        out.write(text + "\n")
        out.flush()


def summary_text(summary: dict) -> str:
    """One line from summary.json's fields."""
    rate = summary.get("samples_per_second")
    parts = [f"summary: {summary['global_step']} steps, {summary['samples_seen']:,} samples "
             f"in {summary['train_seconds']:.1f} s ({human(rate)} samples/s average)"]
    if summary.get("tflops") is not None:
        parts.append(f"{flop_rate(summary['tflops'])} per device"
                     + (f", MFU {100 * summary['mfu']:.1f}%" if summary.get("mfu") is not None
                        else ""))
    account = summary.get("time_account") or {}
    if account.get("goodput") is not None:  # the time account, across restarts
        restarts = account.get("failures", 0)
        parts.append(f"goodput {100 * account['goodput']:.1f}% of {account['wall_seconds']:.1f}"
                     f" s wall" + (f" ({restarts} restart{'s' if restarts != 1 else ''})"
                                   if restarts else ""))
    stopped = summary.get("stopped_early")
    if stopped:
        parts.append(f"stopped early at step {stopped['step']}")
    best = summary.get("best")
    if best:
        parts.append(f"best {best['metric']} {format_value(best['value'])} ({best['mode']}) "
                     f"at step {best['step']}")
    memory = summary.get("peak_memory") or {}
    mem = f"peak memory {mebibytes(memory.get('cpu_rss_bytes'))} RSS"
    if memory.get("cuda_max_allocated_bytes") is not None:
        mem += f", {mebibytes(memory['cuda_max_allocated_bytes'])} CUDA allocated"
    parts.append(mem)
    return " | ".join(parts)


class _AboveBar:
    """A stdout stand-in that lifts the bar, prints, and redraws it (tqdm.write's way)."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress

    def write(self, text: str) -> int:
        bar = self._progress._bar
        isatty = getattr(sys.stdout, "isatty", None)
        if bar is None or not (isatty and isatty()):
            return sys.stdout.write(text)  # stdout goes to a file: the bar is not in its way
        with bar.external_write_mode(file=sys.stdout):
            n = sys.stdout.write(text)
            sys.stdout.flush()  # before the bar is redrawn, or the line lands after it
        return n

    def flush(self) -> None:
        sys.stdout.flush()
