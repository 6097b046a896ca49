"""Number types for command-line options (argparse ``type=``), shared by ``ferry`` and
``ferry-hostagent``: a value out of range is a usage error (exit status 2) before anything runs."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def more_than_zero(text: str) -> float:
    """An interval or a ratio: a finite number above 0 (an interval of 0 would spin)."""
    value = _number(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number above 0")
    return value


def seconds(text: str) -> float:
    """A finite number of seconds, 0 or more."""
    value = _number(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number of seconds from 0 up")
    return value


def whole(low: int, high: int | None = None) -> Callable[[str], int]:
    """A whole number from ``low`` (up to ``high``, when given)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if high is not None and not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in {low}..{high}")
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is less than {low}")
        return value

    return parse
