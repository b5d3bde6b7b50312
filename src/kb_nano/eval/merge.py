"""Tier 3's summary: per eval workload, the candidate/baseline ratio over its (model,
TP) pairs. The merge itself is Tier 2's (:func:`kb_nano.e2e.merge.merge_e2e`). Torch-free."""

from __future__ import annotations

from kb_nano.rows import geomean


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
