"""The terminal: a rich console and the number formatting the tiers' tables share."""

from __future__ import annotations

import math

from rich.console import Console


def num(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt)


def make_console() -> Console:
    """A rich console; 200 columns wide when stdout is not a terminal (logs, pipes)."""
    import sys

    return Console(width=None if sys.stdout.isatty() else 200)
