"""Merge per-scenario kernel shards into ``results/kernels.parquet`` and the JSON report.

Scenarios the manifest marks not applicable (e.g. a TP that does not divide the heads)
have no job; the merge adds one ``skipped`` row per selected candidate with the reason,
so the table says why a shape is missing. Torch-free.
"""

from __future__ import annotations

import json
from pathlib import Path

from kb_nano.files import atomic_write_text
from kb_nano.kernels.schema import COLUMNS, SCHEMA_VERSION, make_row, read_rows, scenario_fields, to_table
from kb_nano.rows import geomean, json_rows, write_table


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


def status_counts(by_status: dict[str, int]) -> str:
    """``"48 passed, 2 unsynced_work, 32 skipped"``: :func:`summarize`'s ``by_status``
    in the words of the rows' statuses (:data:`kb_nano.kernels.schema.STATUSES`), as the
    CLI's summary line, the HTML table and the speedup plot write them."""
    return ", ".join(f"{n} {s}" for s, n in by_status.items())


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

    from kb_nano.kernels.schema import read_signed
    from kb_nano.kernels.signing import verify

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
