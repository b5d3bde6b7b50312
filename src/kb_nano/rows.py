"""Result rows shared by the tiers: a schema's columns filled in, atomic Parquet
writes, rows made JSON-safe, the geometric mean. Each tier's schema lives with the tier
(:mod:`kb_nano.kernels.schema`, :mod:`kb_nano.e2e.schema`). Torch-free."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kb_nano.files import atomic_path


def full_row(tier: str, columns: list[str], statuses: tuple, version: int, fields: dict) -> dict:
    """Every column of a tier's schema present (None where unknown). Raises ``KeyError``
    for a field that is not a column and ``ValueError`` for an unknown status."""
    unknown = set(fields) - set(columns)
    if unknown:
        raise KeyError(f"not {tier}-row columns: {sorted(unknown)}")
    if fields.get("status") not in statuses:
        raise ValueError(f"unknown {tier} status {fields.get('status')!r}")
    row = dict.fromkeys(columns)
    row.update(fields)
    row["schema_version"] = row["schema_version"] or version
    return row


def write_table(table: pa.Table, path: Path) -> None:
    """Write an Arrow table to Parquet atomically."""
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def json_rows(rows: list[dict]) -> list[dict]:
    """Rows with NaN/inf floats replaced by None (JSON has no NaN)."""
    return [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()} for r in rows]


def geomean(values) -> float | None:
    """Geometric mean of positive numbers (None for an empty sequence)."""
    values = [v for v in values if v is not None and v > 0]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def read_shards(paths: list[Path], schema: pa.Schema) -> pa.Table:
    """Concatenate Parquet shards into one table with ``schema``: columns missing from an
    older shard are null, extra columns are dropped. Raises what pyarrow raises for an
    unreadable file (``OSError``, ``pyarrow.ArrowException``)."""
    rows = [row for p in paths for row in pq.read_table(p).to_pylist()]
    return pa.Table.from_pylist(rows, schema=schema)
