"""Merge per-scenario kernel shards into ``results/kernels.parquet`` and the JSON report.

Scenarios the manifest marks not applicable (e.g. a TP that does not divide the heads)
have no job; the merge adds one ``skipped`` row per selected candidate with the reason,
so the table says why a shape is missing. Torch-free.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from kb_nano.files import atomic_write_text
from kb_nano.schema import COLUMNS, SCHEMA_VERSION, make_row, read_rows, scenario_fields, to_table, write_table


def geomean(values) -> float | None:
    """Geometric mean of positive numbers (None for an empty sequence)."""
    values = [v for v in values if v is not None and v > 0]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def summarize(rows: list[dict]) -> dict:
    """Counts per status, pass rate and geometric-mean speedup over passed rows, overall
    and per candidate. ``pass_rate`` = passed / (rows not skipped); ``significant`` =
    passed rows whose speedup interval excludes 1.0; ``review`` = rows flagged for
    review (implausible speedup, :mod:`kb_nano.roofline`)."""

    def block(rs):
        counted = [r for r in rs if r["status"] != "skipped"]
        passed = [r for r in counted if r["status"] == "passed"]
        return {
            "rows": len(rs),
            "by_status": {s: sum(r["status"] == s for r in rs) for s in sorted({r["status"] for r in rs})},
            "pass_rate": len(passed) / len(counted) if counted else None,
            "geomean_speedup": geomean(r["speedup"] for r in passed),
            "significant": sum(bool(r.get("significant")) for r in passed),
            "review": sum(bool(r.get("review")) for r in rs),
        }

    candidates = sorted({r["candidate"] for r in rows})
    return {
        **block(rows),
        "per_candidate": {c: block([r for r in rows if r["candidate"] == c]) for c in candidates},
    }


def merge(
    shards: list[Path],
    not_applicable: list[tuple[dict, str]],
    parquet_out: Path,
    json_out: Path,
    scenarios: dict[str, dict] | None = None,
    secret: bytes | None = None,
) -> list[dict]:
    """Merge ``shards`` plus ``not_applicable`` ``(scenario, candidate_id)`` pairs.

    A shard that cannot be read (truncated, not Parquet) becomes a ``crashed`` row naming
    the file and the fix, found through ``scenarios`` (scenario id -> manifest entry) and
    the shard path ``results/kernels/{target}/{name}/{scenario}.parquet``; the other rows
    are merged as usual. Writes the Parquet table (sorted by level, target, model, tp,
    num_tokens, candidate) and a JSON document ``{schema_version, tier, summary, rows}``,
    both atomically. With ``secret`` (:func:`kb_nano.kernels.signing.key`), the rows of
    a shard whose signature does not match (changed after the judge wrote it, or never
    signed by a judge) become ``tampered`` rows saying so. Returns the rows.
    """
    import pyarrow as pa

    from kb_nano.kernels.signing import verify
    from kb_nano.schema import read_signed

    readable, broken = [], []
    for path in shards:
        try:
            stored, found = read_signed(Path(path))
        except (OSError, pa.ArrowException) as exc:
            broken.append((Path(path), exc))
            continue
        if secret is not None and not verify(stored, found, secret):
            why = "its signature does not match" if found else "it carries no judge's signature"
            for r in stored:
                r.update(
                    status="tampered",
                    error=(f"shard {path} changed after the judge wrote it ({why}); delete it and rerun the job"),
                )
        readable.append(to_table([{k: r.get(k) for k in COLUMNS} for r in stored]))
    table = pa.concat_tables(readable) if readable else read_rows([])
    for path, exc in broken:
        reason = (
            f"shard {path} is unreadable ({' '.join(str(exc).split())[:160]}...); delete it and rerun with "
            "`-- --forcerun merge_kernels` (Snakemake does not rerun a job whose output was deleted "
            "when everything downstream is up to date)"
        )
        scenario = (scenarios or {}).get(path.stem)
        if scenario is None:
            raise ValueError(reason)
        row = make_row(
            **scenario_fields(scenario),
            candidate=f"{path.parent.parent.name}/{path.parent.name}",
            status="crashed",
            error=reason,
        )
        table = pa.concat_tables([table, to_table([row])])
    extra = [
        make_row(**scenario_fields(s), candidate=cid, status="skipped", error=f"not applicable: {s['reason']}")
        for s, cid in not_applicable
    ]
    rows = table.to_pylist() + to_table(extra).to_pylist()
    rows.sort(key=lambda r: (r["level"], r["target"], r["model"], r["tp"], r["num_tokens"], r["candidate"]))
    write_table(to_table(rows), parquet_out)
    clean = json_rows(rows)
    doc = {"schema_version": SCHEMA_VERSION, "tier": "kernels", "summary": summarize(clean), "rows": clean}
    atomic_write_text(Path(json_out), json.dumps(doc, indent=1, allow_nan=False) + "\n")
    return rows


def json_rows(rows: list[dict]) -> list[dict]:
    """Rows with NaN/inf floats replaced by None (JSON has no NaN)."""
    return [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()} for r in rows]


def e2e_speedup(row: dict, baseline: dict | None) -> float | None:
    """Speedup of an ``ok`` e2e row over the ``ok`` baseline row of the same model, TP and
    workload: throughput ``total_tokens_per_s / baseline's``; latency
    ``baseline avg_latency_ms / avg_latency_ms``; serve ``baseline mean_e2el_ms /
    mean_e2el_ms`` (mean end-to-end request latency). None when either is missing or failed."""
    if baseline is None or row["status"] != "ok" or baseline["status"] != "ok":
        return None
    if row["kind"] == "serve":
        a, b = baseline.get("mean_e2el_ms"), row.get("mean_e2el_ms")
    elif row["kind"] == "latency":
        a, b = baseline.get("avg_latency_ms"), row.get("avg_latency_ms")
    else:
        a, b = row.get("total_tokens_per_s"), baseline.get("total_tokens_per_s")
    return a / b if a and b else None


def summarize_e2e(rows: list[dict]) -> dict:
    """Counts per status and, per variant, the geometric-mean speedup over its ok rows."""
    variants = sorted({r["variant"] for r in rows})
    return {
        "rows": len(rows),
        "by_status": {s: sum(r["status"] == s for r in rows) for s in sorted({r["status"] for r in rows})},
        "per_variant": {
            v: {
                "rows": sum(r["variant"] == v for r in rows),
                "geomean_speedup": geomean(r["speedup"] for r in rows if r["variant"] == v),
            }
            for v in variants
        },
    }


def summarize_eval(rows: list[dict]) -> dict:
    """Per eval workload, the candidate/baseline ratio (``speedup``: tokens/s ratio for
    throughput, baseline / candidate average latency for latency) over its (model, TP)
    pairs: ``geomean``, ``min``, ``max`` (the spread across models and TPs), ``n`` pairs
    measured, ``n_failed`` candidate rows without a ratio, and for latency workloads the
    per-pair ratio of the p25 and p75 latencies ``[p75_base / p75_cand, p25_base / p25_cand]``
    (the spread within runs) as ``iqr_ratio`` ``[lowest, highest]`` over the pairs."""
    out: dict[str, dict] = {}
    by_key = {(r["model"], r["tp"], r["workload"], r["variant"] == "baseline"): r for r in rows}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        cands = [
            r for r in rows if r["workload"] == workload and r["variant"] != "baseline" and r["status"] != "skipped"
        ]
        ratios = [r["speedup"] for r in cands if r.get("speedup")]
        entry = {
            "kind": cands[0]["kind"] if cands else None,
            "n": len(ratios),
            "n_failed": len(cands) - len(ratios),
            "geomean": geomean(ratios),
            "min": min(ratios) if ratios else None,
            "max": max(ratios) if ratios else None,
        }
        if entry["kind"] == "latency":
            spans = []
            for r in cands:
                b = by_key.get((r["model"], r["tp"], workload, True))
                if (
                    r.get("speedup")
                    and b
                    and all(x.get(k) for x in (r, b) for k in ("p25_latency_ms", "p75_latency_ms"))
                ):
                    spans += [b["p75_latency_ms"] / r["p75_latency_ms"], b["p25_latency_ms"] / r["p25_latency_ms"]]
            entry["iqr_ratio"] = [min(spans), max(spans)] if spans else None
        out[workload] = entry
    return out


def merge_e2e(
    shards: list[Path], parquet_out: Path, json_out: Path, tier: str = "e2e", skipped: list[dict] | None = None
) -> list[dict]:
    """Merge e2e (or eval) shards into ``results/{tier}.parquet`` and a JSON document
    ``{schema_version, tier, summary, rows}`` (both atomic), filling ``speedup`` of
    every row from the baseline row of its model/TP/workload (:func:`e2e_speedup`).
    ``skipped``: rows of jobs that were not run (``skipped`` status, ``error`` = why), kept
    in the result. For ``eval`` the summary adds ``per_workload`` (:func:`summarize_eval`).
    A shard that cannot be read raises ``ValueError`` naming it (delete it and rerun).
    Returns the rows sorted by model, tp, workload, variant (baseline first)."""
    import pyarrow as pa

    from kb_nano.schema import E2E_SCHEMA_VERSION, e2e_table, read_e2e_rows

    rows = []
    for path in shards:
        try:
            rows += read_e2e_rows([Path(path)]).to_pylist()
        except (OSError, pa.ArrowException) as exc:
            raise ValueError(
                f"shard {path} is unreadable ({' '.join(str(exc).split())[:200]}); delete it and rerun"
            ) from None
    from kb_nano.schema import make_e2e_row

    rows += [make_e2e_row(**r) for r in skipped or []]
    base = {(r["model"], r["tp"], r["workload"]): r for r in rows if r["variant"] == "baseline"}
    for r in rows:
        r["speedup"] = e2e_speedup(r, base.get((r["model"], r["tp"], r["workload"])))
    rows.sort(key=lambda r: (r["model"], r["tp"], r["workload"], r["variant"] != "baseline", r["variant"]))
    write_table(e2e_table(rows), parquet_out)
    clean = json_rows(rows)
    summary = summarize_e2e(clean)
    if tier == "eval":
        summary["per_workload"] = summarize_eval(clean)
    doc = {"schema_version": E2E_SCHEMA_VERSION, "tier": tier, "summary": summary, "rows": clean}
    atomic_write_text(Path(json_out), json.dumps(doc, indent=1, allow_nan=False) + "\n")
    return rows
