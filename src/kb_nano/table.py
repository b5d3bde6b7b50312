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
    return "; ".join(notes)


def _ci(r: dict) -> str:
    lo, hi = r.get("speedup_ci_low"), r.get("speedup_ci_high")
    if lo is None or hi is None or (isinstance(lo, float) and math.isnan(lo)):
        return "-"
    return f"{lo:.2f}-{hi:.2f}"


def kernel_table(rows: list[dict], title: str = "kb-nano kernels") -> Table:
    """Table of kernel rows: scenario, candidate, status, max-abs-error, baseline and
    candidate median ms ± IQR (ms), speedup (baseline median / candidate median), its
    95% rerun interval (:func:`kb_nano.kernels.timing.speedup_interval`), and the error, or notes: a roofline "REVIEW" flag,
    "not significant" when the interval contains 1.0, CUDA-graph replay times when
    measured, "golden inputs" (captured tensors, see :mod:`kb_nano.golden`) and a "noisy"
    flag when an IQR exceeds 25% of its median."""
    table = Table(title=title, show_lines=False)
    for col, justify in (
        ("scenario", "left"),
        ("candidate", "left"),
        ("status", "left"),
        ("max_abs_err", "right"),
        ("baseline ms ±IQR", "right"),
        ("candidate ms ±IQR", "right"),
        ("speedup", "right"),
        ("rerun 95%", "right"),
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
            _num(speed, ".2f")
            + ("x" if speed is not None and not (isinstance(speed, float) and math.isnan(speed)) else ""),
            _ci(r),
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
    sig = summary.get("significant")
    review = summary.get("review")
    console.print(
        f"{summary['rows']} rows: {by_status}; pass rate {_num(rate * 100 if rate is not None else None, '.0f')}%"
        + (f"; geomean speedup over passed {_num(gm, '.3f')}x" if _num(gm, ".3f") != "-" else "; no row passed")
        + (
            f"; {sig} of the passed significantly different from the baseline (95% rerun interval excludes 1.0)"
            if sig is not None
            else ""
        )
        + (f"; {review} flagged for REVIEW" if review else "")
    )


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


def e2e_table(rows: list[dict], title: str = "kb-nano e2e (vLLM)") -> Table:
    """Table of e2e rows of one workload: model, tp, variant (the candidates, each with
    the number of forward calls the vLLM plugin counted inside the engine), status, the
    workload's metrics (throughput and serve: requests/s, total and output tokens/s;
    latency: average and p10..p99 ms; serve: TTFT/TPOT/ITL/E2EL mean and p99 ms), speedup
    over the baseline (:func:`kb_nano.merge.e2e_speedup`) and, if any row failed, the error."""
    table = Table(title=title)
    kinds = {r["kind"] for r in rows}
    cols = ["model", "tp", "variant (forward calls)", "status"]
    if kinds & {"throughput", "serve"}:
        cols += ["req/s", "total tok/s", "output tok/s"]
    if "latency" in kinds:
        cols += ["avg ms", "p10 ms", "p25 ms", "p50 ms", "p75 ms", "p90 ms", "p99 ms"]
    serve = [(m, st) for m in ("ttft", "tpot", "itl", "e2el") for st in ("mean", "p99")]
    if "serve" in kinds:
        cols += [f"{m.upper()} {st} ms" for m, st in serve]
    cols += ["speedup"]
    errors = any(r.get("error") for r in rows)
    if errors:
        cols += ["error"]
    for col in cols:
        left = col in ("model", "variant (forward calls)", "status", "error")
        table.add_column(
            col,
            justify="left" if left else "right",
            overflow="fold",
            no_wrap=col in ("model", "variant (forward calls)"),
        )
    for r in rows:
        style = "green" if r["status"] == "ok" else "red"
        cells = [escape(r["model"]), str(r["tp"]), escape(_variant_cell(r)), f"[{style}]{r['status']}[/{style}]"]
        if kinds & {"throughput", "serve"}:
            cells += [
                _num(r.get("requests_per_s"), ".2f"),
                _num(r.get("total_tokens_per_s"), ".1f"),
                _num(r.get("output_tokens_per_s"), ".1f"),
            ]
        if "latency" in kinds:
            cells += [
                _num(r.get(k), ".1f")
                for k in (
                    "avg_latency_ms",
                    "p10_latency_ms",
                    "p25_latency_ms",
                    "p50_latency_ms",
                    "p75_latency_ms",
                    "p90_latency_ms",
                    "p99_latency_ms",
                )
            ]
        if "serve" in kinds:
            cells += [_num(r.get(f"{st}_{m}_ms"), ".1f") for m, st in serve]
        speed = r.get("speedup")
        cells.append(_num(speed, ".3f") + ("x" if speed is not None else ""))
        if errors:
            cells.append(escape(r.get("error") or ""))
        table.add_row(*cells)
    return table


def print_e2e(rows: list[dict], console: Console | None = None) -> None:
    """Print one e2e table per workload (titled with its vLLM settings) and where the
    weights came from."""
    import json

    console = console or make_console()
    for workload in dict.fromkeys(r["workload"] for r in rows):
        group = [r for r in rows if r["workload"] == workload]
        params = json.loads(group[0].get("workload_params") or "{}")
        shown = {"request_rate": "inf", "max_concurrency": "unlimited"}  # vLLM's meaning of unset
        settings = ", ".join(
            f"{k} {shown.get(k, v) if v is None else v}" for k, v in params.items() if k not in ("name", "kind")
        )
        console.print(e2e_table(group, title=f"{group[0]['kind']} {workload}: {settings}"))
    for weights in sorted({r["weights"] for r in rows if r.get("weights")}):
        models = sorted({r["model"] for r in rows if r.get("weights") == weights})
        console.print(f"weights of {', '.join(models)}: {weights}")


def eval_summary_table(summary: dict, rows: list[dict]) -> Table:
    """One line per eval workload: kind, vLLM settings, (model, TP) pairs measured, the
    candidate/baseline ratio (geometric mean over the pairs; >1 = the candidates are
    faster), its spread over the pairs (min-max) and, for latency workloads, the ratio of
    the p75 and p25 latencies (spread within the runs); failed candidate rows."""
    import json

    table = Table(title="kb-nano eval: candidate / baseline per workload")
    for col in (
        "workload",
        "kind",
        "settings",
        "pairs",
        "ratio (geomean)",
        "spread min-max",
        "p75..p25 ratio",
        "failed",
    ):
        table.add_column(col, justify="left" if col in ("workload", "kind", "settings") else "right")
    params = {r["workload"]: json.loads(r.get("workload_params") or "{}") for r in rows}
    for workload, s in summary.items():
        p = params.get(workload, {})
        settings = ", ".join(f"{k} {v}" for k, v in p.items() if k not in ("name", "kind", "dataset_name"))
        spread = f"{s['min']:.3f}-{s['max']:.3f}" if s.get("min") is not None else "-"
        iqr = s.get("iqr_ratio")
        table.add_row(
            escape(workload),
            s.get("kind") or "-",
            escape(settings),
            str(s["n"]),
            _num(s.get("geomean"), ".3f") + ("x" if s.get("geomean") is not None else ""),
            spread,
            f"{iqr[0]:.3f}-{iqr[1]:.3f}" if iqr else "-",
            str(s["n_failed"]),
        )
    return table


def print_eval(doc: dict, console: Console | None = None) -> None:
    """Print an eval result document: the per-job tables (:func:`print_e2e`), the skipped
    (model, TP) pairs with the reason, and the per-workload summary."""
    console = console or make_console()
    rows = doc["rows"]
    run = [r for r in rows if r["status"] != "skipped"]
    if run:
        print_e2e(run, console)
    for r in {(r["model"], r["tp"], r["error"]) for r in rows if r["status"] == "skipped"}:
        console.print(f"skipped {r[0]} tp={r[1]}: {escape(r[2] or '')}")
    console.print(eval_summary_table(doc["summary"]["per_workload"], rows))
