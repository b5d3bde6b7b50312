"""Readable result tables for the terminal (rich)."""

from __future__ import annotations

import math

from rich.console import Console
from rich.markup import escape
from rich.table import Table

STATUS_STYLE = {"passed": "green", "skipped": "yellow"}


def _num(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt)


NOISY_IQR_FRACTION = 0.25  # IQR above this share of the median: the row is flagged noisy


def _ms(median, iqr) -> str:
    if median is None or (isinstance(median, float) and math.isnan(median)):
        return "-"
    return f"{median:.4f} ±{iqr:.4f}" if iqr is not None and not math.isnan(iqr) else f"{median:.4f}"


def _note(r: dict) -> str:
    if r.get("error"):
        return r["error"]
    noisy = [
        side
        for side in ("baseline", "candidate")
        if r.get(f"{side}_ms") and r.get(f"{side}_ms_iqr") is not None
        and r[f"{side}_ms_iqr"] > NOISY_IQR_FRACTION * r[f"{side}_ms"]
    ]
    notes = ["golden inputs"] if r.get("input_source") == "golden" else []
    if noisy:
        notes.append(f"noisy: {' and '.join(noisy)} IQR > {NOISY_IQR_FRACTION:.0%} of median")
    return "; ".join(notes)


def kernel_table(rows: list[dict], title: str = "kb-nano kernels") -> Table:
    """Table of kernel rows: scenario, candidate, status, max-abs-error, baseline and
    candidate median ms ± IQR (ms), speedup (baseline median / candidate median), and the
    error, or notes: "golden inputs" (captured tensors, see :mod:`kb_nano.golden`) and a
    "noisy" flag when an IQR exceeds 25% of its median."""
    table = Table(title=title, show_lines=False)
    for col, justify in (
        ("scenario", "left"),
        ("candidate", "left"),
        ("status", "left"),
        ("max_abs_err", "right"),
        ("baseline ms ±IQR", "right"),
        ("candidate ms ±IQR", "right"),
        ("speedup", "right"),
        ("note", "left"),
    ):
        table.add_column(col, justify=justify, overflow="fold", no_wrap=col in ("scenario", "candidate"))
    for r in rows:
        style = STATUS_STYLE.get(r["status"], "red")
        speed = r.get("speedup")
        table.add_row(
            escape(r["scenario_id"]),
            escape(r["candidate"]),
            f"[{style}]{r['status']}[/{style}]",
            _num(r.get("max_abs_err"), ".3g"),
            _ms(r.get("baseline_ms"), r.get("baseline_ms_iqr")),
            _ms(r.get("candidate_ms"), r.get("candidate_ms_iqr")),
            _num(speed, ".2f") + ("x" if speed is not None and not (isinstance(speed, float) and math.isnan(speed)) else ""),
            escape(_note(r)),
        )
    return table


def make_console() -> Console:
    """A rich console; 200 columns wide when stdout is not a terminal (logs, pipes)."""
    import sys

    return Console(width=None if sys.stdout.isatty() else 200)


def print_kernels(rows: list[dict], summary: dict, console: Console | None = None) -> None:
    """Print the kernel table and a one-line summary (pass rate, geomean speedup)."""
    console = console or make_console()
    console.print(kernel_table(rows))
    by_status = ", ".join(f"{n} {s}" for s, n in summary["by_status"].items())
    rate = summary["pass_rate"]
    gm = summary["geomean_speedup"]
    console.print(
        f"{summary['rows']} rows: {by_status}; pass rate {_num(rate * 100 if rate is not None else None, '.0f')}%"
        f"; geomean speedup over passed {_num(gm, '.3f')}x"
    )
