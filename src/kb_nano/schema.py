"""Kernel result rows (Tier 1): the versioned Parquet schema and atomic shard writes.

Times are milliseconds; ``speedup = baseline_ms / candidate_ms`` (medians); ``*_iqr`` is
the interquartile range (p75 - p25) of the per-call times in ms. ``bytes_moved`` and
``flops`` are the operator's minimum traffic per call (see each operator's ``traffic``).
``gpu_ids`` are the device ids the job leased (``CUDA_VISIBLE_DEVICES`` of its worker,
comma-separated; null for a CPU job; see :mod:`kb_nano.gpus`). Torch-free.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kb_nano.files import atomic_path

SCHEMA_VERSION = 2  # 2: gpu_ids

STATUSES = (
    "passed",
    "incorrect",
    "incorrect_shape",
    "incorrect_dtype",
    "nonfinite",
    "import_error",
    "runtime_error",
    "timeout",
    "crashed",
    "skipped",
)

KERNEL_SCHEMA = pa.schema(
    [
        ("schema_version", pa.int32()),
        ("scenario_id", pa.string()),
        ("target", pa.string()),
        ("level", pa.int32()),
        ("category", pa.string()),
        ("model", pa.string()),
        ("hub_id", pa.string()),
        ("tp", pa.int32()),
        ("num_tokens", pa.int32()),
        ("dtype", pa.string()),
        ("input_shapes", pa.string()),
        ("init_args", pa.string()),
        ("input_source", pa.string()),
        ("seed", pa.int64()),
        ("candidate", pa.string()),
        ("candidate_sha256", pa.string()),
        ("status", pa.string()),
        ("error", pa.string()),
        ("atol", pa.float64()),
        ("rtol", pa.float64()),
        ("max_abs_err", pa.float64()),
        ("max_rel_err", pa.float64()),
        ("baseline_ms", pa.float64()),
        ("candidate_ms", pa.float64()),
        ("speedup", pa.float64()),
        ("baseline_ms_iqr", pa.float64()),
        ("candidate_ms_iqr", pa.float64()),
        ("bytes_moved", pa.int64()),
        ("flops", pa.int64()),
        ("num_warmup", pa.int32()),
        ("num_runs", pa.int32()),
        ("num_threads", pa.int32()),
        ("device", pa.string()),
        ("device_name", pa.string()),
        ("gpu_ids", pa.string()),
        ("torch_version", pa.string()),
        ("triton_version", pa.string()),
        ("kb_nano_version", pa.string()),
        ("git_sha", pa.string()),
        ("created_at", pa.string()),
        ("wall_s", pa.float64()),
    ]
)
COLUMNS = KERNEL_SCHEMA.names


def scenario_fields(scenario: dict) -> dict:
    """Row fields taken from a manifest scenario entry."""
    import json

    return {
        "scenario_id": scenario["scenario_id"],
        "target": scenario["target"],
        "level": scenario["level"],
        "category": scenario["category"],
        "model": scenario["model"],
        "hub_id": scenario.get("hub_id"),
        "tp": scenario["tp"],
        "num_tokens": scenario["num_tokens"],
        "dtype": scenario["dtype"],
        "input_shapes": json.dumps({s["name"]: s["shape"] for s in scenario.get("inputs") or []}),
        "init_args": json.dumps(scenario.get("init_args"), sort_keys=True),
        "input_source": "random",
        "bytes_moved": scenario.get("bytes_moved"),
        "flops": scenario.get("flops"),
    }


def make_row(**fields) -> dict:
    """A full row: every column present (None where unknown). Raises ``KeyError`` for a
    field that is not a column and ``ValueError`` for an unknown status."""
    unknown = set(fields) - set(COLUMNS)
    if unknown:
        raise KeyError(f"not kernel-row columns: {sorted(unknown)}")
    if fields.get("status") not in STATUSES:
        raise ValueError(f"unknown status {fields.get('status')!r}")
    row = dict.fromkeys(COLUMNS)
    row.update(fields)
    row["schema_version"] = row["schema_version"] or SCHEMA_VERSION
    return row


def to_table(rows: list[dict]) -> pa.Table:
    """Rows -> Arrow table with :data:`KERNEL_SCHEMA`."""
    return pa.Table.from_pylist([make_row(**r) for r in rows], schema=KERNEL_SCHEMA)


def write_rows(rows: list[dict], path: Path) -> None:
    """Write rows as a Parquet shard atomically (temporary file in the same directory +
    rename), so a killed job never leaves a half-written shard."""
    write_table(to_table(rows), path)


def write_table(table: pa.Table, path: Path) -> None:
    """Write an Arrow table to Parquet atomically."""
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def read_rows(paths: list[Path]) -> pa.Table:
    """Concatenate shards into one table with :data:`KERNEL_SCHEMA`; columns missing from
    an older shard are null, extra columns are dropped."""
    rows = [row for p in paths for row in pq.read_table(p).to_pylist()]
    return pa.Table.from_pylist(rows, schema=KERNEL_SCHEMA)
