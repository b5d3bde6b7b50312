"""Merge Tier-2 (or Tier-3) shards into ``results/{tier}.parquet`` and its JSON
document, with each row's speedup over the baseline of its model, TP and workload.
Torch-free."""

from __future__ import annotations

import json
from pathlib import Path

from kb_nano.files import atomic_write_text
from kb_nano.rows import geomean, json_rows, write_table


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

    from kb_nano.e2e.schema import E2E_SCHEMA_VERSION, e2e_table, make_e2e_row, read_e2e_rows

    rows = []
    for path in shards:
        try:
            rows += read_e2e_rows([Path(path)]).to_pylist()
        except (OSError, pa.ArrowException) as exc:
            raise ValueError(
                f"shard {path} is unreadable ({' '.join(str(exc).split())[:200]}); delete it and rerun"
            ) from None
    rows += [make_e2e_row(**r) for r in skipped or []]
    base = {(r["model"], r["tp"], r["workload"]): r for r in rows if r["variant"] == "baseline"}
    for r in rows:
        r["speedup"] = e2e_speedup(r, base.get((r["model"], r["tp"], r["workload"])))
    rows.sort(key=lambda r: (r["model"], r["tp"], r["workload"], r["variant"] != "baseline", r["variant"]))
    write_table(e2e_table(rows), parquet_out)
    clean = json_rows(rows)
    summary = summarize_e2e(clean)
    if tier == "eval":
        from kb_nano.eval.merge import summarize_eval

        summary["per_workload"] = summarize_eval(clean)
    doc = {"schema_version": E2E_SCHEMA_VERSION, "tier": tier, "summary": summary, "rows": clean}
    atomic_write_text(Path(json_out), json.dumps(doc, indent=1, allow_nan=False) + "\n")
    return rows
