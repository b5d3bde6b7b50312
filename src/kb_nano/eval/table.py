"""Tier-3 output for the terminal (rich): the per-job tables, the skipped pairs and the
per-workload summary."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kb_nano.console import Column, fit_table, make_console, num
from kb_nano.e2e.table import print_e2e

# ``drop``: left out first on a narrow terminal (kb_nano.console.fit_table)
SUMMARY_COLUMNS = (
    Column("workload", wrap=True, min_width=16),
    Column("kind", drop=2),
    Column("settings", wrap=True, min_width=16, drop=1),
    Column("model×TPs", "right", drop=3),
    Column("ratio (geomean)", "right"),
    Column("spread min-max", "right"),
    Column("p75..p25 ratio", "right", drop=4),
    Column("failed", "right"),
)


def eval_summary_table(summary: dict, rows: list[dict], width: int | None = None) -> Table:
    """One line per eval workload: kind, vLLM settings, (model, TP) pairs measured, the
    candidate/baseline ratio (geometric mean over the pairs; >1 = the candidates are
    faster), its spread over the pairs (min-max) and, for latency workloads, the ratio of
    the p75 and p25 latencies (spread within the runs); failed candidate rows.

    ``width`` (terminal columns; None = no limit): narrower than the full table, the
    settings fold, then the p75..p25 ratio, model×TPs, kind and the settings are left out
    in that order (the caption says which); workload, ratio, spread and failed always stay."""
    import json

    params = {r["workload"]: json.loads(r.get("workload_params") or "{}") for r in rows}
    cells = []
    for workload, s in summary.items():
        p = params.get(workload, {})
        settings = ", ".join(f"{k} {v}" for k, v in p.items() if k not in ("name", "kind", "dataset_name"))
        spread = f"{s['min']:.3f}-{s['max']:.3f}" if s.get("min") is not None else "-"
        iqr = s.get("iqr_ratio")
        cells.append(
            [
                escape(workload),
                s.get("kind") or "-",
                escape(settings),
                str(s["n"]),
                num(s.get("geomean"), ".3f") + ("x" if s.get("geomean") is not None else ""),
                spread,
                f"{iqr[0]:.3f}-{iqr[1]:.3f}" if iqr else "-",
                str(s["n_failed"]),
            ]
        )
    return fit_table(list(SUMMARY_COLUMNS), cells, width, "kb-nano eval: candidate / baseline per workload")


def print_eval(doc: dict, console: Console | None = None) -> None:
    """Print an eval result document: the per-job tables (:func:`print_e2e`), the skipped
    (model, TP) pairs with the reason, and the per-workload summary, the tables fitted
    to the console's width."""
    console = console or make_console()
    rows = doc["rows"]
    run = [r for r in rows if r["status"] != "skipped"]
    if run:
        print_e2e(run, console)
    for r in {(r["model"], r["tp"], r["error"]) for r in rows if r["status"] == "skipped"}:
        console.print(f"skipped {r[0]} tp={r[1]}: {escape(r[2] or '')}")
    console.print(eval_summary_table(doc["summary"]["per_workload"], rows, console.width))
