"""Merge Tier-2 (or Tier-3) shards into ``results/{tier}.parquet`` and its JSON
document: a shard holds one row per engine run of its job (the baseline and the candidate
variant alternately, ``pairs`` times); the merge makes one row per variant with the
speedup over the baseline's runs of the same pairs and its 95% rerun interval.
Torch-free."""

from __future__ import annotations

import json
from pathlib import Path

from kb_nano import stats
from kb_nano.files import atomic_write_text
from kb_nano.rows import geomean, json_rows, write_table


def ratio_terms(row: dict, baseline: dict | None) -> tuple[float | None, float | None]:
    """``(numerator, denominator)`` of an ``ok`` e2e row's speedup over the ``ok``
    baseline row of the same model, TP and workload: throughput ``total_tokens_per_s`` /
    the baseline's; latency the baseline's ``avg_latency_ms`` / the row's; serve the
    baseline's ``mean_e2el_ms`` / the row's (mean end-to-end request latency). ``(None,
    None)`` when either row failed."""
    if baseline is None or row["status"] != "ok" or baseline["status"] != "ok":
        return None, None
    if row["kind"] == "serve":
        return baseline.get("mean_e2el_ms"), row.get("mean_e2el_ms")
    if row["kind"] == "latency":
        return baseline.get("avg_latency_ms"), row.get("avg_latency_ms")
    return row.get("total_tokens_per_s"), baseline.get("total_tokens_per_s")


# the metric columns a merged row takes as the median over its ok runs
METRICS = (
    "requests_per_s",
    "total_tokens_per_s",
    "output_tokens_per_s",
    "num_requests",
    "total_num_tokens",
    "total_output_tokens",
    "elapsed_s",
    *(f"p{q}_latency_ms" for q in (10, 25, 50, 75, 90, 99)),
    "avg_latency_ms",
    *(f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "p50", "p90", "p99")),
    "failed_requests",
)


def _median(values: list) -> float | int | None:
    import statistics

    values = [v for v in values if v is not None]
    if not values:
        return None
    m = statistics.median(values)
    return round(m) if all(isinstance(v, int) for v in values) else float(m)


def combine_runs(rows: list[dict]) -> list[dict]:
    """Per-run rows (one per engine run, ``pair`` = its index in the job) -> one row per
    model, TP, workload and variant. A variant's row is ``ok`` when all its runs were,
    with each metric the median over them (``num_pairs`` = how many); else it is its
    first failed run. ``speedup`` of a candidate variant: over the pairs where both runs
    are ``ok``, the ratio of the medians of the two sides' metrics (:func:`ratio_terms`;
    as Tier 1's, and the ratio of the medians the row shows when every run was ok), with
    the 95% rerun interval over the pairs (:func:`kb_nano.stats.speedup_interval`, Student's
    t as Tier 1's over blocks; with 2 pairs t = 12.7, with 3 pairs 4.3, so few pairs give
    wide intervals; a percentile bootstrap over 3 pairs would only span their range and
    cover far less than 95%) and ``significant`` (the interval excludes 1.0);
    ``pair_speedups`` lists each pair's own ratio. The baseline's row has speedup 1.0.
    Rows without a ``pair`` (``skipped``) pass through as one run."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["tp"], r["workload"], r["variant"]), []).append(r)
    base = {k[:3]: {r.get("pair") or 0: r for r in g} for k, g in groups.items() if k[3] == "baseline"}
    out = []
    for key, runs in groups.items():
        runs.sort(key=lambda r: r.get("pair") or 0)
        ok = [r for r in runs if r["status"] == "ok"]
        failed = next((r for r in runs if r["status"] != "ok"), None)
        row = dict(failed or runs[0], pair=None, num_pairs=len(ok))
        if failed is None:
            row.update({m: _median([r.get(m) for r in ok]) for m in METRICS})
            b = base.get(key[:3], {})
            terms = [ratio_terms(r, b.get(r.get("pair") or 0)) for r in ok]
            terms = [(x, y) for x, y in terms if x and y]
            if terms:
                nums, dens = [x for x, _ in terms], [y for _, y in terms]
                speedup = _median(nums) / _median(dens)
                lo, hi = (None, None)
                if key[3] != "baseline" and len(terms) >= 2:
                    lo, hi = stats.speedup_interval(nums, dens, speedup)
                row.update(
                    speedup=speedup,
                    speedup_ci_low=lo,
                    speedup_ci_high=hi,
                    significant=None if lo is None else bool(lo > 1.0 or hi < 1.0),
                    pair_speedups=json.dumps([round(x / y, 6) for x, y in terms]),
                )
        out.append(row)
    return out


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
    ``{schema_version, tier, summary, rows}`` (both atomic): one row per model, TP,
    workload and variant from the runs' rows (:func:`combine_runs`: medians over the
    pairs, speedup with its 95% rerun interval over them).
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
    rows = combine_runs(rows) + [make_e2e_row(**r) for r in skipped or []]
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
