"""Number types for command-line options (argparse ``type=``), shared by ``ferry`` and
``ferry-hostagent``: a value out of range is a usage error (exit status 2) before anything runs."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

# The most seconds (about a century) an interval or a duration may be, and so the largest ratio too:
# beyond, timedelta and sleeps overflow, and no setting means it.
MAX_SECONDS = 100 * 365 * 24 * 3600
# The largest whole number unless a command says otherwise: the largest integer SQLite (and
# PostgreSQL's bigint) stores; a larger one overflows the driver before any row is compared.
MAX_WHOLE = 2**63 - 1


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def more_than_zero(text: str) -> float:
    """An interval or a ratio: a finite number above 0 (an interval of 0 would spin), up to :data:`MAX_SECONDS`."""
    value = _number(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number above 0")
    if value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text} is more than {MAX_SECONDS}")
    return value


def seconds(text: str) -> float:
    """A finite number of seconds, from 0 up to :data:`MAX_SECONDS` (about a century)."""
    value = _number(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number of seconds from 0 up")
    if value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text} is more than {MAX_SECONDS} seconds (about a century)")
    return value


def whole(low: int, high: int | None = None) -> Callable[[str], int]:
    """A whole number from ``low`` up to ``high`` (when given) or :data:`MAX_WHOLE`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if high is not None and not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in {low}..{high}")
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is less than {low}")
        if value > MAX_WHOLE:
            raise argparse.ArgumentTypeError(f"{value} is more than {MAX_WHOLE}")
        return value

    return parse
