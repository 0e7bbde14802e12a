"""``sailfin report OUTPUT_DIR [--compare DIR ...]``: one PNG per chart against the
optimizer step, ``overview.png`` and ``report.md`` from a run's ``metrics.jsonl`` (and
``summary.json``, ``time_account.json``), every chart overlaying the ``--compare`` runs
(docs/logging-and-report.md). Needs matplotlib, imported only here.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from .logging.time_account_file import COMPONENTS, account_path, account_totals, read_account
from .logging.stdout import flop_rate, flop_unit
from .utils.voice import line

# Training values that are not charted on their own.
_TRAIN_SKIP = {"step", "epoch", "split", "dataset"}


class ReportError(ValueError):
    """A run directory cannot be read; the message names the file and what to do."""


@dataclass
class Run:
    """One run's logged series: name -> (steps, values)."""

    name: str
    path: str
    train: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    val: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    account: Optional[dict[str, Any]] = None  # time_account.json, when present


def load_run(path: str, name: Optional[str] = None) -> Run:
    """Read ``<path>/metrics.jsonl`` (required) and ``<path>/summary.json`` (optional)."""
    metrics = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(metrics):
        raise ReportError(f"{metrics} not found: is {path} a sailfin output_dir? The "
                          "report reads the jsonl writer's file (keep jsonl in trainer.writers)")
    run = Run(name or os.path.basename(os.path.abspath(path)), path)
    with open(metrics, encoding="utf-8") as fh:
        for number, record in enumerate(fh, 1):
            if not record.strip():
                continue
            try:
                event = json.loads(record)
                split, step = event["split"], int(event["step"])
            except (ValueError, KeyError, TypeError):
                if record.endswith("\n"):
                    raise ReportError(f"{metrics}:{number} is not a sailfin metrics record "
                                      f"(JSON with step and split): {record[:80]!r}") from None
                break  # a last line cut short by a crash: chart what was written
            series = run.train if split == "train" else run.val
            prefix = f"{event['dataset']}/" if split != "train" and isinstance(
                event.get("dataset"), str) else ""
            for key, value in event.items():
                if key in _TRAIN_SKIP or isinstance(value, bool) or not isinstance(
                        value, (int, float)):
                    continue
                steps, values = series.setdefault(prefix + key, ([], []))
                # A resumed or restarted run appends to the same file: the later
                # record of a step replaces the earlier ones from there on.
                while steps and steps[-1] >= step:
                    steps.pop()
                    values.pop()
                steps.append(step)
                values.append(float(value))
    if not run.train and not run.val:
        raise ReportError(f"{metrics} holds no metrics yet; report after some logged steps")
    summary = os.path.join(path, "summary.json")
    if os.path.isfile(summary):
        with open(summary, encoding="utf-8") as fh:
            run.summary = json.load(fh)
    run.account, _ = read_account(account_path(path))  # an unreadable one: no chart
    return run


def charts(runs: Sequence[Run]) -> list[tuple[str, str, str, list[tuple[str, str]]]]:
    """(file stem, title, y label, [(split, key)]) for each chart the runs can fill."""
    out = []
    def have(split: str, key: str) -> bool:
        return any(key in (r.train if split == "train" else r.val) for r in runs)

    if have("train", "loss") or have("val", "loss"):
        out.append(("loss", "Loss", "loss", [("train", "loss"), ("val", "loss")]))
    val_keys = sorted({k for r in runs for k in r.val} - {"loss"})
    for key in val_keys:
        stem = "val_" + "".join(c if c.isalnum() else "_" for c in key)
        out.append((stem, f"Validation {key}", key, [("val", key)]))
    out += [(stem, title, ylabel, [("train", key)]) for key, stem, title, ylabel in (
        ("lr", "lr", "Learning rate", "lr"),
        ("samples_per_second", "throughput", "Throughput", "samples/s"),
        ("epsilon", "epsilon", "Privacy spent (ε at δ)", "ε"),
        ("tflops", "tflops", "Model FLOP/s per device", "FLOP/s"),  # unit: see _plot
        ("mfu", "mfu", "Model FLOPs utilisation", "MFU")) if have("train", key)]
    return out


# Measured rates: one slow or fast logging window (a step after a pause, a clock read
# across a save) must not flatten the chart: the axis stops above the rest and the
# values past it are marked on its edge.
_RATES = {"samples_per_second", "tflops", "mfu"}
_FENCE = 3.0  # Tukey's far-out fence: past Q3 + 3 x IQR is a spike


def spike_limit(values: Sequence[float]) -> Optional[float]:
    """The top of the axis when some values are spikes (past Q3 + 3 x IQR of the rest),
    a little above the highest value that is not; None when none is."""
    import numpy as np

    finite = np.asarray([v for v in values if math.isfinite(v)], dtype=float)
    if len(finite) < 4:
        return None
    q1, q3 = np.percentile(finite, [25, 75])
    fence = q3 + _FENCE * max(q3 - q1, 0.05 * abs(q3))
    kept = finite[finite <= fence]
    if len(kept) == len(finite) or not len(kept):
        return None
    return float(kept.max()) * 1.1 if kept.max() > 0 else fence


def _plot(ax: Any, runs: Sequence[Run], title: str, ylabel: str,
          series: list[tuple[str, str]]) -> None:
    scale = 1.0
    if ("train", "tflops") in series:  # in the unit the runs' median reads best in
        values = sorted(v for r in runs for v in r.train.get("tflops", ((), ()))[1]
                        if math.isfinite(v))
        ylabel, scale = flop_unit(values[len(values) // 2] if values else 1.0)
    drawn: list[tuple[list[int], list[float], str]] = []
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        for split, key in series:
            data = (run.train if split == "train" else run.val).get(key)
            if not data:
                continue
            steps, values = data
            values = [v / scale if math.isfinite(v) else float("nan") for v in values]
            label = run.name if len(series) == 1 else f"{run.name} {split}"
            if len(runs) == 1:
                label = split if len(series) > 1 else None
            style = dict(linestyle="-", marker=None) if split == "train" else dict(
                linestyle="--", marker="o", markersize=3)
            ax.plot(steps, values, color=color, label=label, **style)
            drawn.append((steps, values, color))
    if any(key in _RATES for _, key in series):
        _clip_spikes(ax, drawn)
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def _clip_spikes(ax: Any, drawn: list[tuple[list[int], list[float], str]]) -> None:
    """Stop the axis above the values that are no spike; mark each spike on the top edge
    with its value."""
    every = [v for _, values, _ in drawn for v in values if math.isfinite(v)]
    top = spike_limit(every)
    if top is None:
        return
    ax.set_ylim(bottom=min(0.0, min(every)), top=top)  # rates: from 0
    for steps, values, color in drawn:
        for step, value in zip(steps, values):
            if math.isfinite(value) and value > top:
                ax.plot([step], [top], marker="^", color=color, markersize=7, clip_on=False)
                text = f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
                ax.annotate(f"{text} (off the axis)", (step, top), xytext=(7, -4),
                            textcoords="offset points", fontsize="small", color=color,
                            va="top", bbox=dict(boxstyle="square,pad=0.1", fc="white",
                                                ec="none", alpha=0.8))


def render(dirs: Sequence[str], out_dir: Optional[str] = None, dpi: int = 100) -> list[str]:
    """Render the charts and report.md for ``dirs[0]`` (overlaying the others).

    Returns the paths written. Example::

        render(["outputs/digits"])                       # -> outputs/digits/report/
        render(["outputs/a", "outputs/b"], "cmp", dpi=80)
    """
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError:
        raise ModuleNotFoundError("sailfin report needs matplotlib: "
                                  "pip install 'sailfin[report]'") from None
    runs = _named([load_run(d) for d in dirs])
    out_dir = out_dir or os.path.join(dirs[0], "report")
    os.makedirs(out_dir, exist_ok=True)
    written: list[str] = []

    def save(name: str, write: Any) -> None:  # whole or not at all
        path = os.path.join(out_dir, name)
        write(f"{path}.tmp-{os.getpid()}")
        os.replace(f"{path}.tmp-{os.getpid()}", path)
        written.append(path)

    def save_png(name: str, fig: Any) -> None:
        save(name, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))

    specs = charts(runs)
    for stem, title, ylabel, series in specs:
        fig = Figure(figsize=(6.4, 4.0), layout="constrained")
        _plot(fig.subplots(), runs, title, ylabel, series)
        save_png(f"{stem}.png", fig)
    cols = 2 if len(specs) > 1 else 1
    rows = math.ceil(len(specs) / cols)
    fig = Figure(figsize=(5.0 * cols, 3.2 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (stem, title, ylabel, series) in zip(axes, specs):
        _plot(ax, runs, title, ylabel, series)
    for ax in axes[len(specs):]:
        ax.set_visible(False)
    fig.suptitle("sailfin: " + " vs ".join(r.name for r in runs))
    save_png("overview.png", fig)
    bars = [(run, seg) for run in runs if run.account for seg in run.account["segments"]]
    if bars:
        fig = Figure(figsize=(7.0, 2.6 + 0.45 * len(bars)), layout="constrained")
        _goodput_bars(fig, bars, len(runs) > 1)
        save_png("goodput.png", fig)
    text = markdown(runs, [os.path.basename(p) for p in written])
    save("report.md", lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return written


# One colour per component of the time account: productive green, losses warm.
_COMPONENT_COLORS = {"productive": "#2ca02c", "replayed": "#d62728", "startup": "#ff7f0e",
                     "restart_gap": "#7f7f7f", "data_wait": "#9467bd", "checkpoint": "#1f77b4",
                     "snapshot": "#17becf", "validation": "#bcbd22", "oom_retries": "#e377c2",
                     "other": "#c7c7c7"}


def _goodput_bars(fig: Any, bars: list[tuple[Run, dict[str, Any]]], named: bool) -> None:
    """One horizontal bar per restart segment, its seconds stacked by component."""
    ax = fig.subplots()
    labels = []
    for row, (run, seg) in enumerate(bars):
        left = 0.0
        for key in COMPONENTS:
            width = seg["seconds"].get(key, 0.0)
            if width > 0:
                ax.barh(row, width, left=left, color=_COMPONENT_COLORS[key],
                        label=key if key not in ax.get_legend_handles_labels()[1] else None)
                left += width
        labels.append((f"{run.name} " if named else "") + f"#{seg['restart']} steps "
                      f"{seg['from_step']}-{seg['step']}")
    ax.set_yticks(range(len(bars)), labels)
    ax.invert_yaxis()  # the first start on top
    ax.set_xlabel("seconds (restart gap, start-up, training, ...)")
    runs = [r for i, (r, _) in enumerate(bars) if i == 0 or bars[i - 1][0] is not r]
    goodput = [(f"{r.name} " if named else "")
               + f"{100 * (account_totals(r.account or {})['goodput'] or 0):.1f}%" for r in runs]
    ax.set_title("Where the time went, per start: goodput " + ", ".join(goodput))
    fig.legend(fontsize="small", ncols=5, loc="outside lower center")


def _named(runs: list[Run]) -> list[Run]:
    """Give runs with the same directory name their parent's name too."""
    names = [r.name for r in runs]
    for run in runs:
        if names.count(run.name) > 1:
            parent = os.path.basename(os.path.dirname(os.path.abspath(run.path)))
            run.name = f"{parent}/{run.name}"
    return runs


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _flops_text(summary: dict) -> str:
    """Average model FLOP/s per device over the run, and MFU when the peak is known."""
    tflops, mfu = summary.get("tflops"), summary.get("mfu")
    if tflops is None:
        return "–"
    return flop_rate(tflops) + (f" ({100 * mfu:.1f}%)" if mfu is not None else "")


def markdown(runs: Sequence[Run], images: Sequence[str]) -> str:
    """The report's text: one table row per run, then the charts."""
    lines = [f"# Training report: {' vs '.join(r.name for r in runs)}", ""]
    lines += ["| run | steps | samples | train time (s) | samples/s | best | final validation "
              "| peak RSS (MiB) | FLOP/s per device (MFU) |",
              "| --- | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: |"]
    for run in runs:
        s = run.summary
        best = s.get("best")
        best_text = (f"{best['metric']} {_fmt(best['value'])} ({best['mode']}) at step "
                     f"{best['step']}" if best else "–")
        final = ", ".join(f"{k} {_fmt(v[1][-1])}" for k, v in sorted(run.val.items())) or "–"
        rss = (s.get("peak_memory") or {}).get("cpu_rss_bytes")
        steps = s.get("global_step", max((st[-1] for st, _ in run.train.values()), default=None))
        lines.append(f"| {run.name} | {_fmt(steps)} | {_fmt(s.get('samples_seen'))} | "
                     f"{_fmt(s.get('train_seconds'))} | {_fmt(s.get('samples_per_second'))} | "
                     f"{best_text} | {final} | {_fmt(rss / 2**20 if rss else None)} | "
                     f"{_flops_text(s)} |")
    lines.append("")
    lines += [f"{run.name}: {run.summary['stopped_early']['reason']} (step "
              f"{run.summary['stopped_early']['step']})." for run in runs
              if run.summary.get("stopped_early")]
    if any(run.summary.get("stopped_early") for run in runs):
        lines.append("")
    for run in runs:
        if run.account:
            totals = account_totals(run.account)
            spent = ", ".join(f"{k} {v:.4g} s" for k, v in totals["seconds"].items() if v > 0)
            lines.append(f"{run.name}: goodput {100 * (totals['goodput'] or 0):.1f}% of "
                         f"{totals['wall_seconds']:.4g} s wall, {totals['segments']} start(s), "
                         f"{totals['failures']} restart(s) after a failure: {spent}.")
    if any(run.account for run in runs):
        lines.append("")
    if any(not r.summary for r in runs):
        lines += ["Runs without summary.json (still running, or stopped early) show only "
                  "what metrics.jsonl holds.", ""]
    lines += [f"![{os.path.splitext(name)[0]}]({name})" for name in images]
    return "\n".join(lines) + "\n"


def report_command(output_dir: str, compare: Sequence[str] = (), out: Optional[str] = None,
                   dpi: int = 100) -> int:
    """The CLI's ``report`` subcommand; returns the exit status."""
    try:
        written = render([output_dir, *compare], out, dpi)
    except ReportError as exc:
        line(f"sailfin report: {exc}")
        return 2
    print(f"report: {len(written)} files in {os.path.dirname(written[0])}: "
          + ", ".join(os.path.basename(p) for p in written))
    return 0
