"""The terminal: a rich console, the number formatting the tiers' tables share, and
tables that fit the terminal's width (:func:`fit_table`)."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table
from rich.text import Text


def num(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt)


def make_console() -> Console:
    """A rich console as wide as the terminal, or ``$COLUMNS`` when set (rich reads it);
    200 columns wide when stdout is not a terminal (logs, pipes) and ``$COLUMNS`` is unset."""
    import sys

    columns = os.environ.get("COLUMNS", "")
    return Console(width=None if sys.stdout.isatty() or columns.isdigit() else 200)


@dataclass(frozen=True)
class Column:
    """One column of :func:`fit_table`. ``header`` may hold line breaks (a two-line
    header is as wide as its longer line). ``drop``: 0 = always shown; when the table is too
    wide the columns with the largest ``drop`` are left out first. ``wrap``: the cells may
    fold onto several lines (then at least ``min_width`` characters wide); False keeps
    every cell on one line (numbers, statuses). ``max_width``: a wrapping column is never
    made wider (its long cells wrap), leaving the room to the other columns."""

    header: str
    justify: str = "left"
    drop: int = 0
    wrap: bool = False
    min_width: int = 8
    max_width: int | None = None


def _cell_width(markup: str) -> int:
    return max((Text.from_markup(line).cell_len for line in markup.splitlines()), default=0)


def fit_table(
    columns: list[Column], rows: list[list[str]], width: int | None = None, title: str | None = None
) -> Table:
    """A rich table of ``rows`` (cells are rich markup, one per column) that fits ``width``
    terminal columns: the columns of the largest ``drop`` level are left out, level by
    level, until the kept ones fit: a wrapping column at ``min_width``, the others at
    their widest cell, and the ``drop`` 0 columns unfolded next to a level above 1 (only
    ``drop`` 1 columns may make them fold). The room left is shared out, the ``drop`` 0
    columns first. If even the ``drop`` 0 columns do not fit, their wrapping ones are narrowed
    further (the one-line ones keep their width). The caption names the columns left out.
    ``width`` None: every column at its widest cell."""
    natural = [
        min(max([_cell_width(c.header), *(_cell_width(r[i]) for r in rows)]), c.max_width or 10**6)
        for i, c in enumerate(columns)
    ]
    # a wrapping column: at least min_width, and its header's longest word unbroken
    need = [
        min(n, max([c.min_width, *(len(w) for w in c.header.split())])) if c.wrap else n
        for n, c in zip(natural, columns)
    ]
    if width is None:
        return _table(columns, rows, dict(enumerate(natural)), title, [])
    keep = list(range(len(columns)))

    def room() -> int:  # the box takes one space of padding each side and len(keep) + 1 rules
        return width - 3 * len(keep) - 1 - sum(widths[i] for i in keep)

    for level in sorted({c.drop for c in columns if c.drop > 0}, reverse=True):
        # only the drop-1 columns may make the drop-0 ones fold; a higher level stays
        # when the drop-0 columns fit unfolded next to it
        widths = [natural[i] if c.drop == 0 and level > 1 else need[i] for i, c in enumerate(columns)]
        if room() >= 0:
            break
        keep = [i for i in keep if columns[i].drop != level]
    widths = list(need)
    while room() < 0:
        wrapping = [i for i in keep if columns[i].wrap and widths[i] > 4]
        if not wrapping:
            break
        widths[max(wrapping, key=lambda i: widths[i])] -= 1
    for level in sorted({columns[i].drop for i in keep}):
        group = [i for i in keep if columns[i].drop == level]
        while room() > 0:
            short = [i for i in group if widths[i] < natural[i]]
            if not short:
                break
            widths[max(short, key=lambda i: natural[i] - widths[i])] += 1
    left_out = [" ".join(c.header.split()) for i, c in enumerate(columns) if i not in keep]
    return _table(columns, rows, {i: widths[i] for i in keep}, title, left_out, width)


def break_at_dots(markup: str, width: int) -> str:
    """``markup`` with each word (run of non-spaces) wider than ``width`` that holds dots
    broken onto several lines after dots, each at most ``width`` wide where the dots allow,
    so a dotted name (``layers.*.self_attn.q_norm``, a module path) folds between its
    parts instead of inside one; other words are left to rich's folding."""

    def width_of(text: str) -> int:
        return len(text.replace("\\[", "["))

    def split(match: re.Match) -> str:
        word = match.group(0)
        if width_of(word) <= width or "." not in word[:-1]:
            return word
        lines, line = [], ""
        for part in re.findall(r"[^.]*\.|[^.]+$", word):
            if line and width_of(line + part) > width:
                lines.append(line)
                line = ""
            line += part
        return "\n".join([*lines, line])

    return re.sub(r"\S+", split, markup)


def _table(columns, rows, widths: dict[int, int], title, left_out: list[str], width: int | None = None) -> Table:
    caption = f"left out at {width} columns: {', '.join(left_out)} (a wider terminal shows them)"
    table = Table(title=title, caption=caption if left_out else None)
    for i, w in widths.items():
        c = columns[i]
        table.add_column(c.header, justify=c.justify, width=w, no_wrap=not c.wrap, overflow="fold")
    for r in rows:
        table.add_row(*(break_at_dots(r[i], w) if columns[i].wrap else r[i] for i, w in widths.items()))
    return table
