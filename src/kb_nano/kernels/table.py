"""The kernel table for the terminal (rich): one line per row, then a summary line."""

from __future__ import annotations

import math
from datetime import datetime

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kb_nano.console import Column, fit_table, make_console, num
from kb_nano.kernels.merge import status_counts

STATUS_STYLE = {"passed": "green", "skipped": "yellow"}


NOISY_IQR_FRACTION = 0.25  # IQR above this share of the median: the row is flagged noisy


def _ms(median, iqr) -> str:
    if median is None or (isinstance(median, float) and math.isnan(median)):
        return "-"
    return f"{median:.4f} ±{iqr:.4f}" if iqr is not None and not math.isnan(iqr) else f"{median:.4f}"


def _note_parts(r: dict) -> list[str]:
    """The notes of one row: its error alone, else the flags below, in this order."""
    if r.get("error"):
        return [r["error"]]
    noisy = [
        side
        for side in ("baseline", "candidate")
        if r.get(f"{side}_ms")
        and r.get(f"{side}_ms_iqr") is not None
        and r[f"{side}_ms_iqr"] > NOISY_IQR_FRACTION * r[f"{side}_ms"]
    ]
    notes = [f"REVIEW {r['review']}"] if r.get("review") else []
    if r.get("significant") is False:
        notes.append("not significant: the 95% rerun interval contains 1.0")
    if r.get("graph_speedup") is not None:
        notes.append(
            f"CUDA graph {r['baseline_graph_ms']:.4f} vs {r['candidate_graph_ms']:.4f} ms = {r['graph_speedup']:.2f}x"
        )
    elif r.get("graph_error"):
        notes.append(f"no CUDA graph: {r['graph_error']}")
    if r.get("input_source") == "golden":
        notes.append("golden inputs")
    if noisy:
        notes.append(f"noisy: {' and '.join(noisy)} IQR > {NOISY_IQR_FRACTION:.0%} of median")
    return notes


def footnoted_notes(rows: list[dict]) -> tuple[list[str], list[str]]:
    """Each row's note cell and the footnotes under the table: a note part that two or
    more rows share (an error every ``num_tokens`` of a scenario gets, "not significant")
    is written once as ``[n] text`` below the table and its rows show ``[n]``; a part only
    one row has stays in its cell. Returns ``(cells, footnotes)``, one cell per row."""
    parts = [_note_parts(r) for r in rows]
    counts: dict[str, int] = {}
    for row_parts in parts:
        for part in dict.fromkeys(row_parts):
            counts[part] = counts.get(part, 0) + 1
    numbers: dict[str, int] = {}
    for row_parts in parts:
        for part in row_parts:
            if counts[part] > 1 and part not in numbers:
                numbers[part] = len(numbers) + 1
    cells = ["; ".join(f"[{numbers[p]}]" if p in numbers else p for p in row_parts) for row_parts in parts]
    return cells, [f"[{n}] {p}" for p, n in numbers.items()]


def _error(r: dict) -> str:
    """``max_abs_err (NN%)``: the error and the share of the allowed error the worst
    element used (``tolerance_used``; rows of schema 5 and older have none)."""
    text, used = num(r.get("max_abs_err"), ".3g"), r.get("tolerance_used")
    if text == "-" or used is None or (isinstance(used, float) and math.isnan(used)):
        return text
    return f"{text} ({used * 100:.0f}%)" if used < 10 else f"{text} (>1000%)"


def load_warning(rows: list[dict]) -> str | None:
    """One line when any row was measured while the host's 1-minute load average
    (``load_avg_start`` or ``load_avg_end``) exceeded the CPUs available to its judge
    (``cpus_available``): how many of the rows with a speedup (the timed ones: not a
    skipped or failed row), the highest load and what it means; None when none was (or no
    row recorded its load: schema 5 and older)."""
    loaded, judged = [], [r for r in rows if r.get("speedup") is not None]
    for r in judged:
        loads = [v for v in (r.get("load_avg_start"), r.get("load_avg_end")) if v is not None]
        if loads and r.get("cpus_available") and max(loads) > r["cpus_available"]:
            loaded.append((max(loads), r["cpus_available"]))
    if not loaded:
        return None
    peak, cpus = max(loaded)
    return (
        f"warning: {len(loaded)} of {len(judged)} rows were measured on a loaded host (load average up to "
        f"{peak:.1f} on {cpus} CPUs available): their times, rerun intervals and significance are unreliable; "
        "rerun them on an idle host"
    )


def _ci(r: dict) -> str:
    lo, hi = r.get("speedup_ci_low"), r.get("speedup_ci_high")
    if lo is None or hi is None or (isinstance(lo, float) and math.isnan(lo)):
        return "-"
    return f"{lo:.2f}-{hi:.2f}"


# The kernel table's columns; ``drop``: left out first when the terminal is too narrow
# (max_abs_err, then the medians, then the note); the rest is always shown.
COLUMNS = (
    Column("scenario", wrap=True, min_width=20),
    Column("candidate", wrap=True, min_width=14),
    Column("status"),
    Column("max_abs_err\n(% of allowed)", "right", drop=3),
    Column("baseline ms ±IQR", "right", drop=2),
    Column("candidate ms ±IQR", "right", drop=2),
    Column("speedup", "right"),
    Column("rerun 95%", "right"),
    Column("note", wrap=True, min_width=16, drop=1),
)


def kernel_table(
    rows: list[dict], title: str = "kb-nano kernels", width: int | None = None, notes: list[str] | None = None
) -> Table:
    """Table of kernel rows: scenario, candidate, status, max-abs-error with the share of
    the allowed error it used (``tolerance_used``), baseline and
    candidate median ms ± IQR (ms), speedup (baseline median / candidate median), its
    95% rerun interval (:func:`kb_nano.stats.speedup_interval`), and the error, or notes: a roofline "REVIEW" flag,
    "not significant" when the interval contains 1.0, CUDA-graph replay times when
    measured, "golden inputs" (captured tensors, see :mod:`kb_nano.models.golden`) and a "noisy"
    flag when an IQR exceeds 25% of its median.

    ``width`` (terminal columns; None = no limit): narrower than the full table, the
    note folds and max_abs_err, the medians and then the note are left out (the caption
    says which); scenario, candidate, status, speedup and rerun 95% always stay.
    ``notes``: the note cell of each row (default: every note written out in full;
    :func:`footnoted_notes` gives shared notes as footnote marks)."""
    notes = notes if notes is not None else ["; ".join(_note_parts(r)) for r in rows]
    cells = []
    for r, note in zip(rows, notes):
        style = STATUS_STYLE.get(r["status"], "red")
        speed = r.get("speedup")
        cells.append(
            [
                escape(r["scenario_id"]),
                escape(r["candidate"]),
                f"[{style}]{r['status']}[/{style}]",
                _error(r),
                _ms(r.get("baseline_ms"), r.get("baseline_ms_iqr")),
                _ms(r.get("candidate_ms"), r.get("candidate_ms_iqr")),
                num(speed, ".2f")
                + ("x" if speed is not None and not (isinstance(speed, float) and math.isnan(speed)) else ""),
                _ci(r),
                escape(note),
            ]
        )
    return fit_table(list(COLUMNS), cells, width, title)


def measured_since(rows: list[dict], started_at: str) -> list[dict] | None:
    """The rows one invocation measured, when it reused others: the rows whose
    ``created_at`` (ISO-8601 UTC, seconds) is at or after ``started_at``. None when no row
    is older than ``started_at`` (a first run: every row is this run's; rows no job
    measured, such as not-applicable scenarios, have no ``created_at``) or none is newer
    (nothing measured): the whole selection is then what to show."""
    start = datetime.fromisoformat(started_at)
    when = [datetime.fromisoformat(r["created_at"]) if r.get("created_at") else None for r in rows]
    new = [r for r, t in zip(rows, when) if t is not None and t >= start]
    older = any(t is not None and t < start for t in when)
    return new if new and older else None


def print_kernels(
    rows: list[dict], summary: dict, console: Console | None = None, shown: list[dict] | None = None
) -> None:
    """Print the kernel table, fitted to the console's width, with notes that several
    rows share as footnotes (:func:`footnoted_notes`), and a one-line summary (pass rate,
    geomean speedup) of all ``rows``. ``shown``: the rows the table holds (default all);
    fewer, a line says how many of the selection are not shown and where they are."""
    console = console or make_console()
    shown = rows if shown is None else shown
    cells, footnotes = footnoted_notes(shown)
    console.print(kernel_table(shown, width=console.width, notes=cells))
    for line in footnotes:
        console.print(escape(line), soft_wrap=False, overflow="fold")
    if len(shown) < len(rows):
        more = len(rows) - len(shown)
        console.print(
            f"{more} more {'row' if more == 1 else 'rows'} of this selection not shown (measured by earlier runs "
            "with the same code and inputs, or not applicable); --all-rows prints them"
        )
    by_status = status_counts(summary["by_status"])
    rate = summary["pass_rate"]
    gm = summary["geomean_speedup"]
    sig = summary.get("significant")
    review = summary.get("review")
    passed = num(gm, ".3f") != "-"
    console.print(
        f"{summary['rows']} row{'' if summary['rows'] == 1 else 's'}: {by_status}; "
        + (f"pass rate {rate * 100:.0f}%" if rate is not None else "no row ran (all skipped)")
        + (f"; geomean speedup over passed {num(gm, '.3f')}x" if passed else "; no row passed")
        + (
            f"; {sig} of the passed significantly different from the baseline (95% rerun interval excludes 1.0)"
            if sig is not None and passed
            else ""
        )
        + (f"; {review} flagged for REVIEW" if review else "")
        + (
            f" ({unseen} of them in rows not shown: --all-rows)"
            if review and (unseen := _unseen_review(rows, shown))
            else ""
        ),
    )


def _unseen_review(rows: list[dict], shown: list[dict]) -> int:
    """How many rows flagged for REVIEW are among ``rows`` but not in ``shown``."""
    seen = {id(r) for r in shown}
    return sum(1 for r in rows if r.get("review") and id(r) not in seen)
