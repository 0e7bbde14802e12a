"""Config errors and the "did you mean" helper."""

from __future__ import annotations

import difflib
import reprlib
from typing import Any, Iterable


class ConfigError(ValueError):
    """A config value or key is wrong; the message names it and says what to do."""


def suggest(name: Any, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or ``""`` (also for a
    value that is no short string: nothing is close to it)."""
    if isinstance(name, (int, float)) and not isinstance(name, bool):
        name = str(name)
    if not isinstance(name, str) or len(name) > 200:
        return ""
    choices = list(choices)
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    if not close:
        # A key typed with the wrong separator ("train-batch-size") is still close.
        normalised = {c.replace("_", "").lower(): c for c in choices}
        hit = normalised.get(name.replace("_", "").replace("-", "").lower())
        close = [hit] if hit else []
    return f" (did you mean '{close[0]}'?)" if close else ""


def unknown_key(key: str, choices: Iterable[str], where: str) -> ConfigError:
    choices = sorted(choices)
    return ConfigError(
        f"unknown config key '{where}{key}'{suggest(key, choices)}; "
        f"valid keys here: {', '.join(choices)}"
    )


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 3, 60, 60, 40
_SHORT.maxdict = _SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxset = 4
SHORT_CHARS = 160


def short_repr(value: Any) -> str:
    """``repr(value)`` cut to a few items per level and a few levels: an error message
    names a value, it never prints one that a YAML alias expanded to millions of items."""
    text = _SHORT.repr(value)  # each level cut, so this never walks the whole value
    return text if len(text) <= SHORT_CHARS else text[:SHORT_CHARS - 3] + "..."
