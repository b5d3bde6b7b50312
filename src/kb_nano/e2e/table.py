"""Tier-2 tables for the terminal (rich): one per workload."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kb_nano.console import make_console, num


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
    latency: average and p10..p99 ms; serve: TTFT/TPOT/ITL/E2EL mean and p99 ms; each the
    median over the row's runs), speedup over the baseline (the ratio of the medians,
    :func:`kb_nano.e2e.merge.combine_runs`), its 95% rerun interval (bold when
    it excludes 1.0), the ok pairs and, if any row failed, the error."""
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
    cols += ["speedup", "95% interval", "pairs"]
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
                num(r.get("requests_per_s"), ".2f"),
                num(r.get("total_tokens_per_s"), ".1f"),
                num(r.get("output_tokens_per_s"), ".1f"),
            ]
        if "latency" in kinds:
            cells += [
                num(r.get(k), ".1f")
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
            cells += [num(r.get(f"{st}_{m}_ms"), ".1f") for m, st in serve]
        speed, lo, hi = r.get("speedup"), r.get("speedup_ci_low"), r.get("speedup_ci_high")
        cells.append(num(speed, ".3f") + ("x" if speed is not None else ""))
        interval = f"{lo:.3f}-{hi:.3f}" if lo is not None and hi is not None else "-"
        if r.get("significant"):
            interval = f"[bold]{interval}[/bold]"
        cells += [interval, num(r.get("num_pairs"), "d")]
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
