"""Kernel result rows (Tier 1): the versioned Parquet schema and atomic shard writes.

Times are milliseconds; ``speedup = baseline_ms / candidate_ms``, each the median over
blocks of a block's mean call time (:func:`kb_nano.kernels.blocks.estimate`), from the
timer ``speedup_basis`` names (``eager``, ``kernel`` or ``graph``, each also in
columns of its own, see :mod:`kb_nano.kernels.agreement`); ``*_iqr`` is the interquartile
range (p75 - p25) of the per-call times in ms. ``bytes_moved`` and
``flops`` are the operator's minimum traffic per call (see each operator's ``traffic``).
``gpu_ids`` are the device ids the job leased (``CUDA_VISIBLE_DEVICES`` of its judge,
comma-separated; null for a CPU job; see :mod:`kb_nano.gpus`). ``started_at`` / ``ended_at``
(ISO 8601 UTC, microseconds) bound the judge's work on the scenario, which happens while
the job holds its device lease; so two rows holding one device never have overlapping
``[started_at, ended_at]`` (``bench/multi_gpu_report.py`` checks it); ``created_at`` has
seconds only. ``seed`` is the measurement's seed, drawn from the OS (``--seed`` replays
it); ``sandbox`` says how the candidate's worker was confined (``landlock abi N``, or
``none: why``). ``tolerance_used`` is the share of the allowed error
(``atol * min(1, rms(ref)) + rtol * |ref|``, :func:`kb_nano.kernels.compare.compare`) the worst compared
element used (1.0 = at the limit). ``load_avg_start`` / ``load_avg_end`` are the host's
1-minute load average (``os.getloadavg``) when the judge starts and ends the row,
``cpus_available`` the CPUs of its affinity mask (``os.sched_getaffinity``): a load above
it means other work competed for the CPUs (:func:`kb_nano.kernels.table.load_warning`).
Shards of an older ``schema_version`` merge with these columns null. Every shard is signed (:mod:`kb_nano.kernels.signing`). Torch-free.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kb_nano.rows import full_row, read_shards, write_table

SCHEMA_VERSION = 6  # 2: gpu_ids; 3: anti-cheat statuses, paired CI, device-wide and graph timing, roofline, started_at/ended_at; 4: judge and workers (OS seed, sandbox, signed shards); 5: three GPU timers, speedup_basis, blocks, SM clock; 6: tolerance_used, load_avg_start/load_avg_end, cpus_available


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
    # anti-cheat rules (kb_nano.kernels.checks, kb_nano.kernels.guard, the judge)
    "tampered",
    "invalid_output",
    "output_aliased",
    "input_mutated",
    "unsynced_work",
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
        # max |cand - ref| / (atol + rtol * |ref|) over every compared element: 1.0 = at the limit
        ("tolerance_used", pa.float64()),
        ("baseline_ms", pa.float64()),
        ("candidate_ms", pa.float64()),
        ("speedup", pa.float64()),
        ("baseline_ms_iqr", pa.float64()),
        ("candidate_ms_iqr", pa.float64()),
        # 95% interval a rerun's speedup falls in (kb_nano.stats.speedup_interval)
        ("speedup_ci_low", pa.float64()),
        ("speedup_ci_high", pa.float64()),
        ("significant", pa.bool_()),  # the interval excludes 1.0: a rerun lands on the same side of 1
        ("speedup_basis", pa.string()),  # the timer baseline_ms/candidate_ms/speedup come from: eager | kernel | graph
        ("num_blocks", pa.int32()),  # blocks timed (each: an ABAB pair per timer); the interval is over them
        ("stop_reason", pa.string()),  # fixed (CPU) | ci_target | max_timing_s
        ("baseline_eager_ms", pa.float64()),  # eager timer: CPU host clock; CUDA event pair, host launch included
        ("candidate_eager_ms", pa.float64()),
        ("eager_speedup", pa.float64()),
        ("baseline_kernel_ms", pa.float64()),  # CUDA: GPU time of the call's kernels (CUPTI), L2 cold
        ("candidate_kernel_ms", pa.float64()),
        ("kernel_speedup", pa.float64()),
        ("baseline_kernels", pa.int32()),  # CUDA: GPU records (kernels, copies, memsets) per call
        ("candidate_kernels", pa.int32()),
        ("baseline_graph_ms", pa.float64()),  # CUDA: one graph replay of K calls / K
        ("candidate_graph_ms", pa.float64()),
        ("graph_speedup", pa.float64()),
        ("graph_error", pa.string()),  # why a side could not be captured as a CUDA graph
        ("graph_calls", pa.int32()),  # CUDA: K, the calls (input slots, rotating) one graph holds
        ("launch_overhead_ms", pa.float64()),  # CUDA: candidate_eager_ms - candidate_kernel_ms
        ("timer_check", pa.string()),  # CUDA: where the three timers disagree (kb_nano.kernels.agreement)
        ("hidden_work_ms", pa.float64()),  # CUDA: candidate GPU time per batch outside every call (CUPTI)
        ("sm_clock_mhz", pa.float64()),  # CUDA: median SM clock over the blocks (NVML)
        ("sm_clock_min_mhz", pa.float64()),
        ("throttled", pa.bool_()),  # CUDA: NVML reported a power or thermal clock reason during a block
        ("throttle_reasons", pa.string()),
        ("l2_flush", pa.string()),  # CUDA: how the L2 was emptied before each timed call (read)
        ("l2_flush_bytes", pa.int64()),  # CUDA: bytes of that flush (2 x the device's L2, >= 256 MiB)
        ("float32_matmul_precision", pa.string()),  # fixed for both sides
        ("allow_tf32", pa.bool_()),
        ("num_trials", pa.int32()),  # correctness trials before timing (edge-case trials not counted)
        ("sandbox", pa.string()),  # how the candidate's worker was confined: "landlock abi N" or "none: why"
        ("roofline_ms", pa.float64()),  # lower bound of one call from measured peaks (kb_nano.roofline)
        ("device_copy_gbps", pa.float64()),  # measured device copy bandwidth, GB/s (read + write)
        ("review", pa.string()),  # set when the result needs a person's look (implausible speedup)
        ("bytes_moved", pa.int64()),
        ("flops", pa.int64()),
        ("num_warmup", pa.int32()),
        ("num_runs", pa.int32()),
        ("num_threads", pa.int32()),
        ("cpus_available", pa.int32()),  # CPUs the judge may run on (its affinity mask)
        ("load_avg_start", pa.float64()),  # the host's 1-minute load average before the judge's work on the row
        ("load_avg_end", pa.float64()),  # ... and after it
        ("device", pa.string()),
        ("device_name", pa.string()),
        ("gpu_ids", pa.string()),
        ("torch_version", pa.string()),
        ("triton_version", pa.string()),
        ("kb_nano_version", pa.string()),
        ("git_sha", pa.string()),
        ("created_at", pa.string()),
        ("started_at", pa.string()),
        ("ended_at", pa.string()),
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
    """A full kernel row (:data:`KERNEL_SCHEMA`; see :func:`kb_nano.rows.full_row`)."""
    return full_row("kernel", COLUMNS, STATUSES, SCHEMA_VERSION, fields)


def to_table(rows: list[dict]) -> pa.Table:
    """Rows -> Arrow table with :data:`KERNEL_SCHEMA`."""
    return pa.Table.from_pylist([make_row(**r) for r in rows], schema=KERNEL_SCHEMA)


def write_rows(rows: list[dict], path: Path, secret: bytes | None = None) -> None:
    """Write rows as a Parquet shard atomically (temporary file in the same directory +
    rename), so a killed job never leaves a half-written shard; with ``secret`` signed
    (:mod:`kb_nano.kernels.signing`)."""
    table = to_table(rows)
    if secret is not None:
        from kb_nano.kernels.signing import METADATA_KEY, signature

        table = table.replace_schema_metadata({METADATA_KEY: signature(table.to_pylist(), secret)})
    write_table(table, path)


def read_signed(path: Path) -> tuple[list[dict], str | None]:
    """A shard's rows as stored and its signature (None when unsigned)."""
    from kb_nano.kernels.signing import METADATA_KEY

    table = pq.read_table(path)
    meta = table.schema.metadata or {}
    found = meta.get(METADATA_KEY)
    return table.to_pylist(), found.decode() if found else None


def read_rows(paths: list[Path]) -> pa.Table:
    """Concatenate shards into one table with :data:`KERNEL_SCHEMA`; columns missing from
    an older shard are null, extra columns are dropped."""
    return read_shards(paths, KERNEL_SCHEMA)
