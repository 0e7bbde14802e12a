"""The time account: where a run's wall time went, across every restart, and its goodput
(the share that became kept training); the components are docs/goodput.md's. Rank 0
keeps it at boundaries that exist already (start, each save, each epoch end, the end):
nothing runs per step; the data wait is the loop's own clock around ``next(batches)``
(``data_seconds``), and no thread is needed."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Optional

from ...logging.metrics_log import last_logged_step
from ...logging.time_account_file import (COMPONENTS, VERSION, account_path, account_totals,
                                             read_account, run_start_time, set_summary_field,
                                             write_account)
from ...utils.voice import say
from ..core.callbacks import Callback
from ..core.view import epoch_number

if TYPE_CHECKING:
    from ..core.view import RunView


_MARKS = 64            # (step, productive seconds) points kept per segment
_SNAPSHOT_WRITE = 1.0  # seconds between writes when snapshots come every step


class TimeAccount(Callback):
    """Keeps ``<output_dir>/time_account.json`` and puts its totals in ``summary.json``.
    The trainer builds one for every run, before the resume trims ``metrics.jsonl``."""

    def __init__(self, output_dir: str, is_main: bool, continues: bool = True) -> None:
        self.active = is_main
        self.path = account_path(output_dir)
        self.started = run_start_time()
        self.account: dict[str, Any] = {"version": VERSION, "segments": []}
        self.reached: Optional[int] = None
        self.last_sign: Optional[float] = None
        self._segment: Optional[dict[str, Any]] = None
        self._stalls = {"checkpoint": 0.0, "snapshot": 0.0}
        self._loop_end: Optional[float] = None
        self._last_write = 0.0
        if is_main and continues:  # resume: auto or a path; never starts a new account
            previous, problem = read_account(self.path)
            if problem:
                say(f"time account: {problem}; starting a new one", warning=True)
            if previous is not None:
                self.account = previous
            metrics = os.path.join(output_dir, "metrics.jsonl")
            self.reached = last_logged_step(metrics)
            # The previous start's last sign of life: its last metrics line (or account write).
            self.last_sign = os.path.getmtime(metrics) if os.path.exists(metrics) else None

    # -- the boundaries -----------------------------------------------------------------
    def on_train_start(self, trainer: "RunView") -> None:
        if not self.active:
            return
        self._train_start = time.perf_counter()
        wall_start = time.time()
        segments, step = self.account["segments"], trainer.global_step
        seg = {"started": self.started, "last_seen": wall_start, "restart": len(segments),
               "world_size": trainer.dist.world_size, "from_step": step, "step": step,
               "failure": False, "ended": None, "replayed_estimated": 0.0,
               "seconds": dict.fromkeys(COMPONENTS, 0.0), "marks": [[step, 0.0]]}
        seg["seconds"]["startup"] = max(0.0, wall_start - self.started)
        if segments:
            _after_restart(segments, seg, step, self.reached, self.started, self.last_sign)
        segments.append(seg)
        self._segment = seg
        self._view = trainer  # summary_fields() brings the account up to the loop's end
        self._validation0 = trainer.validation_seconds
        self._oom0 = _retry_seconds(trainer)
        self._data0 = trainer.data_seconds
        self.write(trainer, durable=True)

    def on_save_end(self, trainer: "RunView", kind: str, seconds: float) -> None:
        if self._segment is None:
            return
        self._stalls["checkpoint" if kind == "checkpoint copy" else kind] += seconds
        if kind == "checkpoint" or time.perf_counter() - self._last_write >= _SNAPSHOT_WRITE:
            self.write(trainer, durable=kind == "checkpoint")

    def on_epoch_end(self, trainer: "RunView") -> None:
        if self._segment is not None:
            self.write(trainer)

    def summary_fields(self) -> dict[str, Any]:
        """Called once the loop is done (summary.json): training time stops here."""
        if self._segment is None:
            return {}
        # The loop ends here (max_steps may end it inside an epoch, after the last write):
        # every step it trained is counted now, then the account stops counting the loop.
        self.write(self._view)
        self._loop_end = time.perf_counter()
        return {"time_account": self.totals()}

    def on_train_end(self, trainer: "RunView") -> None:
        """After the final save (and summary_fields): the segment ends, the totals go to
        summary.json, the end line and the writers."""
        if self._segment is None:
            return
        self._segment["ended"] = "finished"
        self.write(trainer, durable=True)
        totals = self.totals()
        summary = trainer.summary
        if summary is not None and summary.get("nothing_trained"):
            self._segment = None  # the account has the segment; the finished run's files stay
            return
        path = os.path.join(trainer.args.output_dir, "summary.json")
        if summary is not None and os.path.exists(path):
            summary["time_account"] = totals
            set_summary_field(path, "time_account", totals)
        metrics = {"goodput": totals["goodput"], "wall_seconds": totals["wall_seconds"],
                   "restarts": totals["failures"]}
        metrics.update({f"{k}_seconds": v for k, v in totals["seconds"].items()})
        trainer.writers.log_run_totals(metrics, trainer.global_step,
                                       epoch_number(trainer.epoch, trainer.step_in_epoch))
        self._segment = None

    # -- the numbers --------------------------------------------------------------------
    def write(self, trainer: "RunView", durable: bool = False) -> None:
        """Bring the current segment up to now and replace the file."""
        seg = self._segment
        assert seg is not None
        now = time.perf_counter()
        seg["last_seen"] = time.time()
        seg["step"] = trainer.global_step
        sec = seg["seconds"]
        sec.update(self._stalls)  # checkpoint, snapshot
        sec["validation"] = max(0.0, trainer.validation_seconds - self._validation0)
        sec["oom_retries"] = max(0.0, _retry_seconds(trainer) - self._oom0)
        if self._loop_end is None:  # still training: the loop's time not spent otherwise
            self._account_loop(seg, now, trainer.data_seconds - self._data0)
        if "unaccounted_steps" in seg:  # (a restart: the previous segment is before it)
            _settle_gap(self.account["segments"][-2], seg)
        # The segment so far: its gap, then process start to now; what is not measured.
        total = sec["restart_gap"] + (seg["last_seen"] - seg["started"])
        sec["other"] = max(0.0, total - sum(v for k, v in sec.items() if k != "other"))
        self._last_write = now
        write_account(self.path, self.account, durable)

    def _account_loop(self, seg: dict[str, Any], now: float, data_wait: float) -> None:
        """The loop's time up to ``now`` that no other component took is productive."""
        sec = seg["seconds"]
        loop = now - self._train_start
        sec["data_wait"] = max(0.0, data_wait)
        sec["productive"] = max(0.0, loop - sec["data_wait"] - sec["checkpoint"]
                                - sec["snapshot"] - sec["validation"] - sec["oom_retries"])
        marks = seg["marks"]
        if marks[-1][0] == seg["step"]:
            marks[-1][1] = sec["productive"]
        else:
            marks.append([seg["step"], sec["productive"]])
        if len(marks) > _MARKS:
            del marks[1]  # the first (the segment's start) stays: it anchors rollbacks

    def totals(self) -> dict[str, Any]:
        return account_totals(self.account)


def _after_restart(segments: list[dict[str, Any]], seg: dict[str, Any], step: int,
                   reached: Optional[int], started: float, last_sign: Optional[float]) -> None:
    """A new segment resumed at ``step``: earlier training past it was thrown away, and the
    time since the previous segment's last sign of life is a restart gap (or idle, if it
    ended)."""
    prev = segments[-1]
    for earlier in segments:
        _roll_back(earlier, step)
    if prev.get("ended") == "finished":
        seg["idle_before"] = max(0.0, started - prev["last_seen"])  # a run extended: no failure
        return
    seg["failure"] = True
    # It lived until its last metrics line, if that came after its account's last write.
    last = prev["last_seen"]
    if last_sign is not None and last < last_sign <= started:
        last = last_sign
    tail = last - prev["last_seen"]
    prev["seconds"]["other"] += tail
    prev["last_seen"] = last
    seg["seconds"]["restart_gap"] = started - last
    # Steps it trained after that write: kept ones (the checkpoint is newer than the
    # write: snapshots write it at most once a second) were productive, the others
    # (logged in metrics.jsonl, then lost) replayed. Their time is in its tail, and past
    # the tail in the gap; it moves at the step time, once one is known (_settle_gap).
    prev_step = prev["step"]
    seg["unaccounted_steps"] = {"kept": max(0, step - prev_step),
                                "lost": max(0, (reached or 0) - max(prev_step, step)),
                                "tail": tail}
    _settle_gap(prev, seg)


def _settle_gap(prev: dict[str, Any], seg: dict[str, Any]) -> None:
    """Give the previous segment the time of the steps it trained after its account's last
    write, from its tail and then this segment's restart gap, at its step time (or this
    one's, when it wrote no step: killed before its first save)."""
    steps = seg["unaccounted_steps"]
    step_seconds = _step_seconds(prev) or _step_seconds(seg)
    if not step_seconds and (steps["kept"] or steps["lost"]):
        return  # no step time yet: the next write settles it
    tail, gap = steps["tail"], seg["seconds"]["restart_gap"]
    kept = min(tail + gap, steps["kept"] * step_seconds)
    lost = min(tail + gap - kept, steps["lost"] * step_seconds)
    from_tail = min(tail, kept + lost)
    prev["seconds"]["other"] -= from_tail
    seg["seconds"]["restart_gap"] = gap - (kept + lost - from_tail)
    prev["seconds"]["productive"] += kept
    prev["seconds"]["replayed"] += lost
    prev["replayed_estimated"] = prev.get("replayed_estimated", 0.0) + lost
    del seg["unaccounted_steps"]


def _step_seconds(seg: dict[str, Any]) -> float:
    marks = seg["marks"]
    steps = marks[-1][0] - marks[0][0]
    return (marks[-1][1] - marks[0][1]) / steps if steps > 0 else 0.0


def _productive_at(marks: list[list[float]], step: int) -> float:
    """Productive seconds when the segment reached ``step`` (linear between marks)."""
    if step <= marks[0][0]:
        return marks[0][1]
    for (s0, p0), (s1, p1) in zip(marks, marks[1:]):
        if step <= s1:
            return p0 + (p1 - p0) * (step - s0) / (s1 - s0)
    return marks[-1][1]


def _roll_back(seg: dict[str, Any], step: int) -> None:
    """Training of ``seg`` past ``step`` was not kept: productive -> replayed."""
    marks = seg["marks"]
    if marks[-1][0] <= step:
        return
    kept = _productive_at(marks, step)
    sec = seg["seconds"]
    moved = min(marks[-1][1] - kept, sec["productive"])
    sec["productive"] -= moved
    sec["replayed"] += moved
    seg["marks"] = [m for m in marks if m[0] < step] + [[max(step, marks[0][0]), kept]]


def _retry_seconds(trainer: "RunView") -> float:
    return trainer.autobatch.retry_seconds if trainer.autobatch is not None else 0.0

