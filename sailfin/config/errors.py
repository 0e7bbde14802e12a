"""Config errors and the "did you mean" helper."""

from __future__ import annotations

import difflib
from typing import Iterable


class ConfigError(ValueError):
    """A config value or key is wrong; the message names it and says what to do."""


def suggest(name: str, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or ``""``."""
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
