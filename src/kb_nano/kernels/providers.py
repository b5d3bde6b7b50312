"""Providers side by side: one table per (operator, model, TP, variant), one line per
``num_tokens``, one column per provider (the baseline, then each candidate), as
``triton.testing.perf_report`` prints a benchmark.

Each candidate is measured against the baseline in its own paired job (one Snakemake job
and shard per scenario x candidate, so editing one candidate re-measures only its rows).
The view therefore shows, per scenario:

- the baseline's time once: the median of the baseline medians that the scenario's
  passed rows measured (each row times the same baseline code on the same shapes; the
  per-row values stay in the merged files);
- per candidate: its median time, the achieved bandwidth (``bytes_moved`` / time, GB/s)
  and FLOP rate (``flops`` / time, TFLOP/s) where the operator declares them, and its speedup with the 95% rerun interval
  from its own pairing (:func:`kb_nano.stats.speedup_interval`), with the baseline time
  of that pairing (``vs ... ms paired``): the speedup is over that time, which can differ
  from the baseline column when the candidates' jobs ran at different times;
- with ``versus``: each other candidate's time relative to that candidate
  (``versus_ms / candidate_ms``, above 1 = faster than it), a ratio of two separate
  measurements' medians, without an interval.

Rows that did not pass show their status instead of numbers.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import OrderedDict

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kb_nano.console import make_console

_SCENARIO = re.compile(r"^(?P<head>.+)__n(?P<n>\d+)(?:__(?P<variant>.+))?$")


def _finite(x) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def group_key(row: dict) -> tuple[str, str]:
    """``(group title, variant)`` of a row: the scenario id without its ``__n<num_tokens>``
    part (``rms_norm__llama31-8b__tp1``), and the variant suffix after it (``ctx1024``, or
    ``""``). Raises ``ValueError`` for an id without ``__n<digits>``."""
    m = _SCENARIO.match(row["scenario_id"])
    if m is None:
        raise ValueError(f"scenario id {row['scenario_id']!r} has no __n<num_tokens> part")
    return m["head"], m["variant"] or ""


def scenario_view(rows: list[dict]) -> OrderedDict:
    """The merged kernel rows regrouped: ``{(group, variant): {"providers": [candidate
    ids in first-seen order], "lines": {num_tokens: {"baseline_ms", "baseline_gbps",
    candidate id: row}}}}``, groups and lines in first-seen and ascending ``num_tokens``
    order. ``baseline_ms`` is the median of the passed rows' ``baseline_ms`` (None when
    none passed); ``baseline_gbps`` / ``baseline_tflops``: :func:`gbps` / :func:`tflops`
    of it (None without ``bytes_moved`` / ``flops``)."""
    view: OrderedDict = OrderedDict()
    for r in rows:
        key = group_key(r)
        g = view.setdefault(key, {"providers": [], "lines": {}})
        if r["candidate"] not in g["providers"]:
            g["providers"].append(r["candidate"])
        g["lines"].setdefault(int(r["num_tokens"]), {})[r["candidate"]] = r
    for g in view.values():
        g["lines"] = dict(sorted(g["lines"].items()))
        for line in g["lines"].values():
            passed = [r for r in line.values() if r["status"] == "passed" and _finite(r.get("baseline_ms"))]
            base = statistics.median(r["baseline_ms"] for r in passed) if passed else None
            nbytes = next((r.get("bytes_moved") for r in passed if _finite(r.get("bytes_moved"))), None)
            flops = next((r.get("flops") for r in passed if _finite(r.get("flops"))), None)
            line["baseline_ms"] = base
            line["baseline_gbps"] = gbps(nbytes, base)
            line["baseline_tflops"] = tflops(flops, base)
    return view


def gbps(nbytes, ms) -> float | None:
    """Achieved bandwidth in GB/s (1e9 bytes/s) of ``nbytes`` moved in ``ms``; None when
    either is unknown or ``ms`` is not positive."""
    if not _finite(nbytes) or not _finite(ms) or ms <= 0:
        return None
    return float(nbytes) / (ms * 1e-3) / 1e9


def tflops(flops, ms) -> float | None:
    """Achieved TFLOP/s (1e12 floating-point operations per second) of ``flops`` in
    ``ms``; None when either is unknown or ``ms`` is not positive."""
    if not _finite(flops) or not _finite(ms) or ms <= 0 or flops <= 0:
        return None
    return float(flops) / (ms * 1e-3) / 1e12


def _time_cell(ms, rate, tf=None) -> str:
    if not _finite(ms):
        return "-"
    return (
        f"{ms:.4f} ms"
        + (f"\n{rate:.3g} GB/s" if rate is not None else "")
        + (f"\n{tf:.3g} TFLOP/s" if tf is not None else "")
    )


def _candidate_cell(r: dict | None, versus_ms: float | None, is_versus: bool) -> str:
    if r is None:
        return "-"
    if r["status"] != "passed":
        color = "yellow" if r["status"] == "skipped" else "red"
        why = str(r.get("error") or "")
        why = why if len(why) <= 120 else why[:119] + "…"  # the whole reason: the plain table, kernels.json
        return f"[{color}]{escape(r['status'])}[/{color}]" + (f"\n{escape(why)}" if why else "")
    ms = r.get("candidate_ms")
    text = escape(_time_cell(ms, gbps(r.get("bytes_moved"), ms), tflops(r.get("flops"), ms)))
    speed, lo, hi = r.get("speedup"), r.get("speedup_ci_low"), r.get("speedup_ci_high")
    if _finite(speed):
        mark = "" if r.get("significant") is not False else " ~"
        text += f"\n{speed:.2f}x" + (f" [{lo:.2f}-{hi:.2f}]" if _finite(lo) and _finite(hi) else "") + mark
        if _finite(r.get("baseline_ms")):
            text += f"\nvs {r['baseline_ms']:.4f} ms paired"  # the baseline time its speedup is over
    if versus_ms is not None and not is_versus and _finite(r.get("candidate_ms")) and r["candidate_ms"] > 0:
        text += f"\nvs: {versus_ms / r['candidate_ms']:.2f}x"
    return text


def provider_tables(rows: list[dict], versus: str | None = None) -> list[Table]:
    """One rich table per group of :func:`scenario_view`: ``num_tokens``, the baseline's
    time (GB/s, TFLOP/s where known), then per candidate its time (GB/s, TFLOP/s), speedup and 95% rerun interval
    (``~`` when the interval contains 1.0), and with ``versus`` (a candidate id) the
    ratio to that candidate's time. Raises ``ValueError`` when ``versus`` is not a
    candidate of the rows."""
    if versus is not None and versus not in {r["candidate"] for r in rows}:
        known = ", ".join(sorted({r["candidate"] for r in rows})) or "none"
        raise ValueError(f"--versus {versus}: not a candidate of these results (candidates: {known})")
    tables = []
    for (head, variant), g in scenario_view(rows).items():
        title = head.replace("__", " ") + (f" {variant}" if variant else "")
        t = Table(title=escape(title), show_lines=True, title_justify="left")
        t.add_column("num_tokens", justify="right")
        t.add_column("baseline", justify="right")
        for cand in g["providers"]:
            t.add_column(escape(cand) + (" (versus)" if cand == versus else ""), justify="right")
        for n, line in g["lines"].items():
            vrow = line.get(versus) if versus else None
            versus_ms = vrow.get("candidate_ms") if vrow and vrow["status"] == "passed" else None
            cells = [str(n), escape(_time_cell(line["baseline_ms"], line["baseline_gbps"], line["baseline_tflops"]))]
            cells += [_candidate_cell(line.get(c), versus_ms, c == versus) for c in g["providers"]]
            t.add_row(*cells)
        tables.append(t)
    return tables


def print_providers(rows: list[dict], versus: str | None = None, console: Console | None = None) -> None:
    """Print :func:`provider_tables` and a line saying how to read them. Raises
    ``ValueError`` as :func:`provider_tables` does."""
    console = console or make_console()
    for t in provider_tables(rows, versus):
        console.print(t)
    console.print(
        "baseline: median of the baseline times paired with each candidate; speedup [95% rerun interval] over "
        "the candidate's own paired baseline time, shown under it (~: the interval contains 1.0)"
        + (f"; vs: {versus}'s time / this candidate's time (no interval)" if versus else "")
    )
