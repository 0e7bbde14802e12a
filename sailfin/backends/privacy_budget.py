"""The privacy a run may still spend: epsilon of an accountant's history, the noise that
keeps ``target_epsilon`` a bound across resumes (docs/dp.md), and the table the logged
epsilon and ``max_epsilon`` read. A history is a list of segments ``(noise_multiplier,
sample_rate, steps)``; a resumed run adds a segment to the one it inherited.

Example::

    history = [(1.1, 0.2, 10)]                       # a checkpoint's accountant history
    sigma, eps = solve_noise("rdp", history, 0.2, 10, 1 / 47, target=3.0)
    table = EpsilonTable("rdp", history, sigma, 0.2, 1 / 47, steps=10)
    table(10) <= 3.0                                 # True
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np

from ..config.errors import ConfigError

#: One segment of an accountant's history, as Opacus's accountants keep it.
Entry = tuple  # (noise_multiplier: float, sample_rate: float, steps: int)

MAX_NOISE = 1e6    # no noise multiplier beyond this is tried (Opacus's search stops there too)
TOLERANCE = 0.01   # a solved noise spends within this of the target (Opacus's default)
_CHUNK = 1024      # rows of the epsilon table computed together


def extended(history: Sequence[Entry], sigma: float, rate: float, steps: int) -> list[Entry]:
    """``history`` after ``steps`` more steps at ``(sigma, rate)``, merged into its last
    segment when that one ran at the same noise and rate (as the accountants' ``step``)."""
    out = [tuple(h) for h in history]
    if steps <= 0:
        return out
    if out and out[-1][0] == sigma and out[-1][1] == rate:
        out[-1] = (sigma, rate, int(out[-1][2]) + steps)
    else:
        out.append((sigma, rate, steps))
    return out


def new_accountant(mechanism: str) -> Any:
    """An Opacus accountant, without GDP's "experimental" warning (docs/dp.md says so)."""
    import warnings

    from opacus.accountants import create_accountant
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return create_accountant(mechanism=mechanism)


_accountant = lru_cache(maxsize=None)(new_accountant)  # one per mechanism, reused


def epsilon_of(mechanism: str, history: Sequence[Entry], delta: float) -> float:
    """Opacus's epsilon at ``delta`` for ``history`` (0 for no steps; may be negative, NaN
    or infinite: the caller decides what such a figure means)."""
    if not history:
        return 0.0
    accountant = _accountant(mechanism)
    accountant.history = [tuple(h) for h in history]
    try:
        return float(accountant.get_epsilon(delta=delta))
    except (ArithmeticError, ValueError):  # e.g. a division by zero at a noise of 1e-200
        return math.nan
    finally:
        accountant.history = []


def bounded(eps: float) -> bool:  # a bound the accountant can stand behind
    return math.isfinite(eps) and eps >= 0


def solve_noise(mechanism: str, history: Sequence[Entry], rate: float, steps: int,
                delta: float, target: float, tolerance: float = TOLERANCE
                ) -> Optional[tuple[float, float]]:
    """The smallest noise multiplier (to ``tolerance`` in epsilon) whose ``steps`` steps at
    ``rate``, composed with ``history``, end at epsilon <= ``target``, and that epsilon;
    None when no noise up to :data:`MAX_NOISE` gets there. With an empty history this is
    the search of Opacus's ``get_noise_multiplier`` (doubling, then bisection)."""

    def eps(sigma: float) -> float:
        value = epsilon_of(mechanism, extended(history, sigma, rate, steps), delta)
        return math.inf if math.isnan(value) else value

    low, high, eps_high = 0.0, 10.0, math.inf
    while eps_high > target:
        high *= 2
        if high > MAX_NOISE:
            return None
        eps_high = eps(high)
    for _ in range(200):  # bisection: at most ~60 halvings reach float resolution
        if target - eps_high <= tolerance:
            break
        mid = (low + high) / 2
        value = eps(mid)
        if value < target:
            high, eps_high = mid, value
        else:
            low = mid
    return high, eps_high


class EpsilonTable:
    """Epsilon after ``k`` steps of one segment (``k`` in ``[0, steps]``) at one noise and
    rate, on top of ``history``: built when the segment starts; looking up a step costs
    an index. The RDP accountant's figure is computed for a block of steps at once with
    the accountant's own formula (the same floats as ``RDPAccountant.get_epsilon``);
    other accountants are asked once per step count looked up, and the answer kept.

    Example::

        table = EpsilonTable("rdp", [], 1.1, 10 / 47, 1 / 47, steps=20)
        table(20), table.last_within(2.0)    # epsilon after 20 steps; steps that fit 2.0
    """

    def __init__(self, mechanism: str, history: Sequence[Entry], sigma: float, rate: float,
                 delta: float, steps: int) -> None:
        self.mechanism, self.history = mechanism, [tuple(h) for h in history]
        self.sigma, self.rate, self.delta, self.steps = sigma, rate, delta, max(0, steps)
        self._known: dict[int, float] = {}
        self._blocks: dict[int, np.ndarray] = {}
        self._rdp: Optional[Callable[[np.ndarray], np.ndarray]] = None
        if mechanism == "rdp":
            try:
                self._rdp = self._rdp_rows()
            except (ArithmeticError, ValueError):  # asked step by step: NaN, refused
                self._rdp = None

    def __call__(self, k: int) -> float:
        """Epsilon (as the accountant reports it) after ``k`` steps of this segment."""
        # No noise: no privacy claimed, nothing to tabulate.
        if k <= 0 or self.sigma == 0 or self._rdp is None:
            return self._at(k)
        block = k // _CHUNK
        rows = self._blocks.get(block)
        if rows is None:
            counts = np.arange(block * _CHUNK, (block + 1) * _CHUNK)
            rows = self._blocks[block] = self._rdp(counts)
        return float(rows[k - block * _CHUNK])

    def _at(self, k: int) -> float:
        value = self._known.get(k)
        if value is None:
            value = self._known[k] = epsilon_of(
                self.mechanism, extended(self.history, self.sigma, self.rate, k), self.delta)
        return value

    def last_within(self, limit: float) -> int:
        """The most steps of this segment (at most ``steps``) whose epsilon stays <= ``limit``
        (-1: not even none, the history alone passes it). Epsilon grows with the steps,
        so a binary search: a few look-ups, once per segment."""
        if not self(0) <= limit:
            return -1
        low, high = 0, self.steps  # self(low) <= limit
        if self(high) <= limit:
            return high
        while high - low > 1:
            mid = (low + high) // 2
            if self(mid) <= limit:
                low = mid
            else:
                high = mid
        return low

    def _rdp_rows(self) -> Callable[[np.ndarray], np.ndarray]:
        """A function: step counts -> epsilon, the RDP accountant's arithmetic per row."""
        from opacus.accountants import RDPAccountant
        from opacus.accountants.analysis.rdp import compute_rdp

        orders = np.atleast_1d(RDPAccountant.DEFAULT_ALPHAS)
        past = self.history
        merge = bool(past) and past[-1][0] == self.sigma and past[-1][1] == self.rate
        before = past[:-1] if merge else past
        offset = int(past[-1][2]) if merge else 0
        # The accountant sums each segment's RDP in history order (sum() starts at 0).
        prefix = sum([compute_rdp(q=q, noise_multiplier=s, steps=n, orders=list(orders))
                      for s, q, n in before])
        one = compute_rdp(q=self.rate, noise_multiplier=self.sigma, steps=1,
                          orders=list(orders))
        term = (np.log(self.delta) + np.log(orders)) / (orders - 1)
        shift = np.log((orders - 1) / orders)

        def rows(counts: np.ndarray) -> np.ndarray:
            rdp = prefix + one[None, :] * (counts[:, None] + offset)
            eps = rdp - term + shift
            nan = np.isnan(eps).all(axis=1)
            eps = np.where(np.isnan(eps), np.inf, eps).min(axis=1)
            eps[nan] = np.inf  # no order bounds it: no privacy
            return eps

        return rows


class Segment(NamedTuple):
    """The noise this run's remaining steps add, chosen once before its first step, with
    the epsilon table of those steps and the line to log when the noise changed."""

    sigma: float
    table: EpsilonTable
    note: Optional[str] = None


def plan_segment(mechanism: str, history: Sequence[Entry], rate: float, delta: float,
                 steps: int, noise_multiplier: Optional[float],
                 target: Optional[float]) -> Segment:
    """The noise for the ``steps`` steps this run may still take, given the ``history``
    its checkpoint spent (empty for a fresh run). With ``target`` (``target_epsilon``):
    the noise the history's last segment ran at if the whole run still ends within the
    target (a resume that changed nothing adds the same noise), else the noise solved for
    the remaining steps given the history; when none keeps the target, or the accountant
    cannot bound the result, a :class:`ConfigError` that names both figures."""
    past = epsilon_of(mechanism, history, delta)
    done = sum(int(h[2]) for h in history)
    where = (f"the checkpoint's {done} steps already spent epsilon {past:.6g}; "
             if history else "")
    if target is None:
        sigma = float(noise_multiplier)
    elif history and history[-1][1] == rate:
        sigma = float(history[-1][0])
    else:
        sigma = -1.0  # solved below
    if mechanism == "gdp" and history and sigma >= 0 and (
            (history[-1][0], history[-1][1]) != (sigma, rate)):
        raise ConfigError(
            f"trainer.dp.accountant gdp accounts one noise_multiplier and sampling rate per "
            f"run: the checkpoint's steps ran at {history[-1][0]:.4g} and "
            f"{history[-1][1]:.4g}, this run's at {sigma:.4g} and {rate:.4g}; resume with "
            "the checkpoint's trainer.train_batch_size and trainer.dp noise settings")
    note = None
    if target is not None:
        keeps = sigma >= 0 and epsilon_of(
            mechanism, extended(history, sigma, rate, steps), delta) <= target
        if not keeps:
            before = sigma
            sigma = _solve_or_refuse(mechanism, history, rate, delta, steps, target,
                                     before, past, where)
            if history:
                note = (f"trainer.dp.target_epsilon {target:g}: {where}the {steps} steps "
                        f"this run adds run at noise_multiplier {sigma:.4g}"
                        + (f" (was {before:.4g})" if before >= 0 else "")
                        + f", so the run ends at epsilon <= {target:g}")
    table = EpsilonTable(mechanism, history, sigma, rate, delta, steps)
    final = table(steps)
    if sigma != 0 and not bounded(final):  # a noise of 0 claims no privacy
        key = (f"trainer.dp.target_epsilon {target:g}" if target is not None else
               f"trainer.dp.noise_multiplier {sigma:.4g}")
        raise ConfigError(
            f"{key}: the accountant ({mechanism}) cannot "
            f"bound epsilon for this run ({final:.4g} after {done + steps} steps at sampling "
            f"rate {rate:.4g}, delta {delta:.3g}); "
            + ("raise noise_multiplier" if not final < 0 else
               "lower noise_multiplier (or train more steps): epsilon this close to 0 is "
               "below what the accountant resolves")
            + (", or set trainer.dp.target_epsilon instead" if target is None else ""))
    return Segment(sigma, table, note)


def _solve_or_refuse(mechanism: str, history: Sequence[Entry], rate: float, delta: float,
                     steps: int, target: float, before: float, past: float,
                     where: str) -> float:
    solved = (None if history and not past < target else
              solve_noise(mechanism, history, rate, steps, delta, target))
    if solved is not None and bounded(solved[1]):
        return solved[0]
    if history:
        sigma = before if before >= 0 else float(history[-1][0])
        would = epsilon_of(mechanism, extended(history, sigma, rate, steps), delta)
        raise ConfigError(
            f"trainer.dp.target_epsilon {target:g} cannot hold: {where}the {steps} steps "
            f"this run adds would bring it to {would:.6g} at noise_multiplier {sigma:.4g}, "
            "and no noise keeps it within the target; raise target_epsilon, or stop "
            f"training (the checkpoint is untouched)")
    why = ("no noise_multiplier up to 1e6 reaches it" if solved is None else
           f"the accountant ({mechanism}) reaches it only at noise_multiplier "
           f"{solved[0]:.4g}, where it reports epsilon {solved[1]:.4g}: it cannot bound an "
           "epsilon this small")
    raise ConfigError(
        f"trainer.dp.target_epsilon {target:g} is unreachable for {steps} steps at sampling "
        f"rate {rate:.4g} and delta {delta:.3g} ({why}); raise target_epsilon, train fewer "
        "steps, or use a smaller train_batch_size")
