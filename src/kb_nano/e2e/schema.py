"""Tier-2 (and Tier-3) result rows: the versioned Parquet schema of one vLLM benchmark
job (model x TP x workload x variant). Throughput metrics are per second of vLLM's
``elapsed_time``; latencies are ms. Torch-free."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from kb_nano.rows import full_row, read_shards

E2E_SCHEMA_VERSION = 2


E2E_STATUSES = (
    "ok",  # vLLM's benchmark finished and wrote its JSON
    "engine_error",  # vLLM failed (e.g. the engine did not start) and no candidate reported an error
    "candidate_error",  # a candidate failed to import, construct or run inside the engine
    "timeout",  # the job ran past e2e.timeout_s; every process of the job was killed
    "crashed",  # the benchmark process was killed by a signal (e.g. out of memory)
    "skipped",  # not run (eval: a TP above the device pool or not dividing the heads); error = why
)


E2E_SCHEMA = pa.schema(
    [
        ("schema_version", pa.int32()),
        ("model", pa.string()),
        ("hub_id", pa.string()),
        ("model_path", pa.string()),
        ("weights", pa.string()),  # "random (--load-format dummy)" or the weights directory
        ("load_format", pa.string()),
        ("tokenizer", pa.string()),
        ("tp", pa.int32()),
        ("workload", pa.string()),
        ("kind", pa.string()),  # throughput | latency | serve
        ("workload_params", pa.string()),  # JSON of the workload's vLLM settings
        ("variant", pa.string()),  # "baseline" or the candidate ids joined by "+"
        ("candidates", pa.string()),  # comma-separated candidate ids ("" for the baseline)
        ("candidate_sha256", pa.string()),  # JSON {candidate id: SHA-256 of its file}
        ("candidate_calls", pa.string()),  # JSON {candidate id: {"constructed": n, "calls": n}} from the plugin
        ("status", pa.string()),
        ("error", pa.string()),
        ("log_path", pa.string()),  # the engine/benchmark log of the job
        ("vllm_json", pa.string()),  # vLLM's own --output-json file of the job
        ("requests_per_s", pa.float64()),
        ("total_tokens_per_s", pa.float64()),
        ("output_tokens_per_s", pa.float64()),
        ("num_requests", pa.int64()),
        ("total_num_tokens", pa.int64()),
        ("total_output_tokens", pa.int64()),
        ("elapsed_s", pa.float64()),
        ("avg_latency_ms", pa.float64()),
        ("p10_latency_ms", pa.float64()),
        ("p25_latency_ms", pa.float64()),
        ("p50_latency_ms", pa.float64()),
        ("p75_latency_ms", pa.float64()),
        ("p90_latency_ms", pa.float64()),
        ("p99_latency_ms", pa.float64()),
        # serve (vllm bench serve's own key names): time to first token, time per output
        # token, inter-token latency, end-to-end request latency, in ms
        ("mean_ttft_ms", pa.float64()),
        ("p50_ttft_ms", pa.float64()),
        ("p90_ttft_ms", pa.float64()),
        ("p99_ttft_ms", pa.float64()),
        ("mean_tpot_ms", pa.float64()),
        ("p50_tpot_ms", pa.float64()),
        ("p90_tpot_ms", pa.float64()),
        ("p99_tpot_ms", pa.float64()),
        ("mean_itl_ms", pa.float64()),
        ("p50_itl_ms", pa.float64()),
        ("p90_itl_ms", pa.float64()),
        ("p99_itl_ms", pa.float64()),
        ("mean_e2el_ms", pa.float64()),
        ("p50_e2el_ms", pa.float64()),
        ("p90_e2el_ms", pa.float64()),
        ("p99_e2el_ms", pa.float64()),
        ("failed_requests", pa.int64()),  # serve: requests vLLM's benchmark saw fail
        # a shard holds one row per engine run (pair = its index); the merge makes one row per
        # variant: metrics the median over its runs, speedup the ratio of the two sides' medians
        # with a 95% rerun interval over the pairs (kb_nano.e2e.merge)
        ("pair", pa.int32()),  # the run's pair index in its job (None in merged rows)
        ("num_pairs", pa.int32()),  # merged rows: the ok runs behind the row
        ("speedup", pa.float64()),  # set by the merge: vs the baseline runs of the same job
        ("speedup_ci_low", pa.float64()),
        ("speedup_ci_high", pa.float64()),
        ("significant", pa.bool_()),  # the interval excludes 1.0
        ("pair_speedups", pa.string()),  # JSON list: each pair's ratio, in pair order
        ("dtype", pa.string()),
        ("max_model_len", pa.int64()),
        ("enforce_eager", pa.bool_()),
        ("seed", pa.int64()),
        ("device", pa.string()),
        ("gpu_ids", pa.string()),  # the leased CUDA device ids (kb_nano.gpus), comma-separated
        ("device_name", pa.string()),
        ("vllm_version", pa.string()),
        ("torch_version", pa.string()),
        ("kb_nano_version", pa.string()),
        ("git_sha", pa.string()),
        ("created_at", pa.string()),
        ("wall_s", pa.float64()),
    ]
)


E2E_COLUMNS = E2E_SCHEMA.names


PERCENTILES = (10, 25, 50, 75, 90, 99)  # vllm bench latency's percentiles (also asked of bench serve)


SERVE_METRICS = ("ttft", "tpot", "itl", "e2el")


def make_e2e_row(**fields) -> dict:
    """A full e2e row (every column of :data:`E2E_SCHEMA`, None where unknown). Raises
    ``KeyError`` for an unknown field and ``ValueError`` for an unknown status.
    Throughput metrics are per second of vLLM's ``elapsed_time``; latencies are ms
    (vLLM reports seconds; ×1000)."""
    return full_row("e2e", E2E_COLUMNS, E2E_STATUSES, E2E_SCHEMA_VERSION, fields)


def e2e_table(rows: list[dict]) -> pa.Table:
    """Rows -> Arrow table with :data:`E2E_SCHEMA`."""
    return pa.Table.from_pylist([make_e2e_row(**r) for r in rows], schema=E2E_SCHEMA)


def read_e2e_rows(paths: list[Path]) -> pa.Table:
    """Concatenate e2e shards into one table with :data:`E2E_SCHEMA` (missing columns null)."""
    return read_shards(paths, E2E_SCHEMA)
