"""Tier-2 tables for the terminal (rich): one per workload."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kb_nano.console import Column, fit_table, make_console, num
from kb_nano.e2e.schema import PERCENTILES, SERVE_METRICS


def _variant_cell(r: dict) -> str:
    """``baseline``, or one line per candidate with the eager forward calls the plugin
    counted in the engine (``(not built)`` when the model never built its layer)."""
    import json

    if not r.get("candidates"):
        return r["variant"]
    calls = json.loads(r.get("candidate_calls") or "{}")
    lines = []
    for cid in r["candidates"].split(","):
        c = calls.get(cid, {})
        lines.append(f"{cid} ×{c['calls']}" if c.get("constructed") else f"{cid} (not built)")
    return "\n".join(lines)


# (header, row field, format) of each metric column, per workload kind
THROUGHPUT_METRICS = (
    ("req/s", "requests_per_s", ".2f"),
    ("total tok/s", "total_tokens_per_s", ".1f"),
    ("output tok/s", "output_tokens_per_s", ".1f"),
)
LATENCY_METRICS = (
    ("avg ms", "avg_latency_ms", ".1f"),
    *((f"p{q} ms", f"p{q}_latency_ms", ".1f") for q in PERCENTILES),
)
SERVE_METRICS_SHOWN = tuple(
    (f"{m.upper()} {st} ms", f"{st}_{m}_ms", ".1f") for m in SERVE_METRICS for st in ("mean", "p99")
)
# The speedup's basis of each kind (kb_nano.e2e.merge.ratio_terms): its headline metric
HEADLINE = {"throughput": "total_tokens_per_s", "latency": "avg_latency_ms", "serve": "mean_e2el_ms"}


def _drop(field: str, kinds: set[str]) -> int:
    """How soon a metric column is left out on a narrow terminal (kb_nano.console.Column;
    the largest first): the other percentiles (6), p50 and p99 (5), the other throughput
    figures and serve means (4), then the pairs (3) and the error (2), and last the
    headline metric of a kind in the table (1)."""
    if field in {HEADLINE[k] for k in kinds if k in HEADLINE}:
        return 1
    if field.startswith(("p50_", "p99_")):
        return 5
    return 6 if field.startswith(tuple(f"p{q}_" for q in PERCENTILES)) else 4


def e2e_table(rows: list[dict], title: str = "kb-nano e2e (vLLM)", width: int | None = None) -> Table:
    """Table of e2e rows of one workload: model, tp, variant (the candidates, each with
    the number of forward calls the vLLM plugin counted inside the engine), status, the
    workload's metrics (throughput and serve: requests/s, total and output tokens/s;
    latency: average and p10..p99 ms; serve: TTFT/TPOT/ITL/E2EL mean and p99 ms; each the
    median over the row's runs), speedup over the baseline (the ratio of the medians,
    :func:`kb_nano.e2e.merge.combine_runs`), its 95% rerun interval (bold when
    it excludes 1.0), the ok pairs and, if any row failed, the error.

    ``width`` (terminal columns; None = no limit): narrower than the full table, columns
    are left out (the caption says which), first the p10/p25/p75/p90 latencies, then p50
    and p99, the other throughput figures and serve means, the pairs, the error (which
    folds first) and last the headline metric (the speedup's basis: total tok/s, avg ms,
    E2EL mean ms); model, tp, variant, status, speedup and its interval always stay
    (folded onto more lines if need be)."""
    kinds = {r["kind"] for r in rows}
    metrics = []
    if kinds & {"throughput", "serve"}:
        metrics += THROUGHPUT_METRICS
    if "latency" in kinds:
        metrics += LATENCY_METRICS
    if "serve" in kinds:
        metrics += SERVE_METRICS_SHOWN
    errors = any(r.get("error") for r in rows)
    columns = [
        Column("model", wrap=True, min_width=10),
        Column("tp", "right"),
        Column("variant (forward calls)", wrap=True, min_width=16),
        Column("status"),
        *(Column(header, "right", drop=_drop(field, kinds)) for header, field, _ in metrics),
        Column("speedup", "right"),
        Column("95% interval", "right"),
        Column("pairs", "right", drop=3),
        *([Column("error", wrap=True, min_width=16, drop=2)] if errors else []),
    ]
    cells = []
    for r in rows:
        style = "green" if r["status"] == "ok" else "red"
        speed, lo, hi = r.get("speedup"), r.get("speedup_ci_low"), r.get("speedup_ci_high")
        interval = f"{lo:.3f}-{hi:.3f}" if lo is not None and hi is not None else "-"
        if r.get("significant"):
            interval = f"[bold]{interval}[/bold]"
        elif r.get("significant") is False:
            interval += " ~"  # (the interval holds 1.0: print_e2e's legend)
        cells.append(
            [
                escape(r["model"]),
                str(r["tp"]),
                escape(_variant_cell(r)),
                f"[{style}]{r['status']}[/{style}]",
                *(num(r.get(field), fmt) for _, field, fmt in metrics),
                num(speed, ".3f") + ("x" if speed is not None else ""),
                interval,
                num(r.get("num_pairs"), "d"),
                *([escape(r.get("error") or "")] if errors else []),
            ]
        )
    return fit_table(columns, cells, width, title)


def print_e2e(rows: list[dict], console: Console | None = None) -> None:
    """Print one e2e table per workload (titled with its vLLM settings), fitted to the
    console's width (:func:`e2e_table`; an interval that contains 1.0 is marked ``~``, with
    a legend line), and where the weights came from."""
    import json

    console = console or make_console()
    for workload in dict.fromkeys(r["workload"] for r in rows):
        group = [r for r in rows if r["workload"] == workload]
        params = json.loads(group[0].get("workload_params") or "{}")
        shown = {"request_rate": "inf", "max_concurrency": "unlimited"}  # vLLM's meaning of unset
        settings = ", ".join(
            f"{k} {shown.get(k, v) if v is None else v}" for k, v in params.items() if k not in ("name", "kind")
        )
        console.print(e2e_table(group, f"{group[0]['kind']} {workload}: {settings}", console.width))
    if any(r.get("significant") is False for r in rows):
        console.print(
            "~ : the 95% rerun interval contains 1.0, so the speedup is not significant (more --pairs narrow it)"
        )
    for weights in sorted({r["weights"] for r in rows if r.get("weights")}):
        models = sorted({r["model"] for r in rows if r.get("weights") == weights})
        console.print(f"weights of {', '.join(models)}: {weights}")
