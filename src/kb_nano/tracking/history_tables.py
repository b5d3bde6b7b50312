"""The tables of ``kb_nano history``: the runs, and ``--compare``'s rows, fitted to the
terminal's width (:func:`kb_nano.console.fit_table`), and the command's output printed
from them (:func:`print_history`)."""

from __future__ import annotations

import math

from rich.markup import escape
from rich.table import Table

from kb_nano.console import Column, fit_table
from kb_nano.errors import KbNanoError
from kb_nano.tracking.store import RUN_NAME_CHARS

# ``drop``: left out first when the terminal is too narrow; drop 0 always stays
RUN_COLUMNS = (
    Column("run"),
    Column("time"),
    Column("tier", drop=2),
    Column("candidates", wrap=True, min_width=16, drop=1),
    Column("rows run", "right", drop=2),
    Column("pass rate", "right"),
    Column("geomean speedup", "right"),
    Column("git sha", drop=3),
)
COMPARE_COLUMNS = (
    Column("scenario", wrap=True, min_width=20),
    Column("candidate", wrap=True, min_width=14),
    Column("status"),
    Column("speedup A (95%)", "right", wrap=True, min_width=11),
    Column("speedup B (95%)", "right", wrap=True, min_width=11),
    Column("change", "right", drop=1),
    Column("significant"),
)
# shown when a compared row's candidate source differs between the two runs
CHANGED_COLUMN = Column("candidate changed", wrap=True, min_width=9)
ONLY_COLUMNS = (
    Column("scenario", wrap=True, min_width=20),
    Column("candidate", wrap=True, min_width=14),
    Column("only in"),
    Column("status"),
)


def _fmt(value, fmt: str, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, fmt) + suffix


def _candidates_text(cands: list[str], width: int = 3) -> str:
    if len(cands) <= width:
        return ", ".join(cands)
    return f"{len(cands)}: " + ", ".join(cands[:width]) + ", …"


def history_table(runs: list[dict], title: str = "kb-nano history", width: int | None = None) -> Table:
    """Rich table of :func:`kb_nano.tracking.history.list_runs` results: run (id prefix,
    the run's name in the MLflow UI), time, tier, candidates, scenarios run, pass rate,
    geometric-mean speedup over passed rows, git sha. ``width`` (terminal columns; None = no limit): narrower than the full
    table, git sha, then tier and rows run, then candidates are left out."""
    cells = []
    for r in runs:
        rate, sha = r["pass_rate"], r["git_sha"] or ""
        cells.append(
            [
                r["run_id"][:RUN_NAME_CHARS],
                r["start_time"].strftime("%Y-%m-%d %H:%M:%S"),
                r["tier"],
                escape(_candidates_text(r["candidates"])),
                _fmt(r["scenarios_run"], ".0f"),
                _fmt(rate * 100 if rate is not None else None, ".0f", "%"),
                _fmt(r["geomean_speedup"], ".3f", "x"),
                (sha or "-")[:12] + ("-dirty" if sha.endswith("-dirty") else ""),
            ]
        )
    return fit_table(list(RUN_COLUMNS), cells, width, title)


def _speedup(value, ci) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}x" + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else "")


def compare_table(result: dict, width: int | None = None) -> Table:
    """Rich table of :func:`kb_nano.tracking.history.compare_runs`: one line per row
    present in both runs, with its status (``A → B`` when it changed, bold), both
    speedups with their 95% rerun intervals, the relative change (red: slower by > 5 %,
    green: faster by > 5 %) and whether the change is significant (``faster``/``slower``:
    the intervals do not overlap; ``no``; ``same row``: one measurement in both runs, a
    reused shard; ``-``: a row without an interval or not passed in both). When some
    row's candidate source differs between the runs, a ``candidate changed`` column marks
    those rows ``yes``: their change reflects the edit. ``width``: as
    :func:`history_table`; the change column goes first."""
    a, b = result["a"], result["b"]
    edited = any(r.get("candidate_changed") for r in result["rows"])
    cells = []
    for r in result["rows"]:
        change = r["change"]
        text = _fmt(change * 100 if change is not None else None, "+.1f", "%")
        if change is not None and abs(change) > 0.05:
            style = "green" if change > 0 else "red"
            text = f"[{style}]{text}[/{style}]"
        status = r["status_a"] if r["status_a"] == r["status_b"] else f"[bold]{r['status_a']} → {r['status_b']}[/bold]"
        sig = "same row" if r.get("same_measurement") else r["significant"] or "-"
        if sig in ("faster", "slower"):
            style = "green" if sig == "faster" else "red"
            sig = f"[{style}]{sig}[/{style}]"
        cells.append(
            [
                escape(r["scenario_id"]),
                escape(r["candidate"]),
                status,
                _speedup(r["speedup_a"], r["ci_a"]),
                _speedup(r["speedup_b"], r["ci_b"]),
                text,
                sig,
                *(["[bold yellow]yes[/bold yellow]" if r.get("candidate_changed") else "-"] if edited else []),
            ]
        )
    title = (
        f"kb-nano compare: A={a['run_id'][:12]} ({a['start_time']:%Y-%m-%d %H:%M}) "
        f"→ B={b['run_id'][:12]} ({b['start_time']:%Y-%m-%d %H:%M}): rows in both runs"
    )
    return fit_table([*COMPARE_COLUMNS, *([CHANGED_COLUMN] if edited else [])], cells, width, title)


def only_table(result: dict, width: int | None = None) -> Table | None:
    """Rich table of the rows only one of the two compared runs has although the other
    run's selection includes them (``added``: only in B; ``removed``: only in A), or None
    when there are none. Rows outside the other run's selection (a filtered rerun) are
    not listed: :func:`kb_nano.tracking.history.compare_summary` counts them."""
    cells = [
        [escape(r["scenario_id"]), escape(r["candidate"]), label, r["status"]]
        for key, label in (("removed", "A (removed)"), ("added", "B (added)"))
        for r in result[key]
    ]
    if not cells:
        return None
    return fit_table(
        list(ONLY_COLUMNS), cells, width, "rows only one run has, though both runs selected them (not compared)"
    )


def print_history(
    uri: str,
    compare: list[str] | None = None,
    *,
    tier: str | None = None,
    target: str | None = None,
    candidate: str | None = None,
    model: str | None = None,
    limit: int = 20,
) -> int:
    """``kb_nano history`` on the MLflow store ``uri``: the runs matching the filters
    (:func:`kb_nano.tracking.history.list_runs`) as a table, or with ``compare``
    (``[RUN_A, RUN_B]``) the rows both runs have with their speedup changes and whether
    each is significant, the rows only one has, and a summary line
    (:func:`kb_nano.tracking.history.compare_runs`); read through the MLflow client.
    Tables fit the console's width. Returns 0. A store MLflow cannot read (e.g. a corrupt
    SQLite file) raises ``KbNanoError`` (one line)."""
    try:
        _print_history(uri, compare, tier=tier, target=target, candidate=candidate, model=model, limit=limit)
    except KbNanoError:
        raise
    except Exception as exc:
        if not type(exc).__module__.startswith(("sqlalchemy", "mlflow", "sqlite3", "alembic")):
            raise
        raise KbNanoError(
            f"the MLflow store {uri} cannot be read ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:160]}); move it away or point --tracking-uri elsewhere"
        ) from None
    return 0


def _print_history(uri: str, compare: list[str] | None, **filters) -> None:
    from kb_nano.console import make_console
    from kb_nano.tracking import history

    console = make_console()
    if compare:
        result = history.compare_runs(uri, *compare)
        console.print(compare_table(result, width=console.width))
        only = only_table(result, width=console.width)
        if only is not None:
            console.print(only)
        console.print(history.compare_summary(result))
        return
    runs = history.list_runs(uri, **filters)
    shown = ", ".join(f"{k} {v}" for k, v in filters.items() if v and k != "limit")
    if not runs:
        print(f"no kb-nano runs{' matching ' + shown if shown else ''} in {uri}")
        return
    title = "kb-nano history" + (f" ({shown})" if shown else "")
    console.print(history_table(runs, title=title, width=console.width))
    print(f"store: {uri}")
