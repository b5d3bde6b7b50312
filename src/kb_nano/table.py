"""Readable result tables for the terminal (rich)."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

STATUS_STYLE = {"passed": "green", "skipped": "yellow"}


def _num(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt)


def kernel_table(rows: list[dict], title: str = "kb-nano kernels") -> Table:
    """Table of kernel rows: scenario, candidate, status, max-abs-error, baseline ms,
    candidate ms, speedup (baseline median / candidate median), and the error if any."""
    table = Table(title=title, show_lines=False)
    for col, justify in (
        ("scenario", "left"),
        ("candidate", "left"),
        ("status", "left"),
        ("max_abs_err", "right"),
        ("baseline ms", "right"),
        ("candidate ms", "right"),
        ("speedup", "right"),
        ("note", "left"),
    ):
        table.add_column(col, justify=justify, overflow="fold", no_wrap=col in ("scenario", "candidate"))
    for r in rows:
        style = STATUS_STYLE.get(r["status"], "red")
        speed = r.get("speedup")
        table.add_row(
            r["scenario_id"],
            r["candidate"],
            f"[{style}]{r['status']}[/{style}]",
            _num(r.get("max_abs_err"), ".3g"),
            _num(r.get("baseline_ms"), ".4f"),
            _num(r.get("candidate_ms"), ".4f"),
            _num(speed, ".2f") + ("x" if speed is not None and not (isinstance(speed, float) and math.isnan(speed)) else ""),
            r.get("error") or "",
        )
    return table


def print_kernels(rows: list[dict], summary: dict, console: Console | None = None) -> None:
    """Print the kernel table and a one-line summary (pass rate, geomean speedup)."""
    import sys

    console = console or Console(width=None if sys.stdout.isatty() else 200)
    console.print(kernel_table(rows))
    by_status = ", ".join(f"{n} {s}" for s, n in summary["by_status"].items())
    rate = summary["pass_rate"]
    gm = summary["geomean_speedup"]
    console.print(
        f"{summary['rows']} rows: {by_status}; pass rate {_num(rate * 100 if rate is not None else None, '.0f')}%"
        f"; geomean speedup over passed {_num(gm, '.3f')}x"
    )
