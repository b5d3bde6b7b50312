"""Tier 2 rows: the schema, a job's pairs in ABBA order, the merge into ratios with a rerun
interval and the JSON schema, bad CLI input, the MLflow run and the job's environment."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from workflow_helpers import REPO, TINY, copy_workflow, kb_nano

from kb_nano import stats
from kb_nano.e2e import plan as e2e_plan
from kb_nano.e2e.merge import merge_e2e
from kb_nano.e2e.schema import E2E_COLUMNS, E2E_STATUSES, e2e_table, make_e2e_row
from kb_nano.e2e.vllm_plugin import ENV_CALLS_DIR, ENV_CANDIDATES
from kb_nano.rows import write_table

# ----------------------------------------------------------------------------- rows, merge, JSON


def _row(variant, **metrics):
    return make_e2e_row(
        model="tiny-llama",
        tp=1,
        workload="w",
        kind=metrics.pop("kind", "latency"),
        variant=variant,
        status=metrics.pop("status", "ok"),
        weights="random (--load-format dummy)",
        **metrics,
    )


def test_e2e_row_rejects_unknown_fields_and_statuses():
    with pytest.raises(KeyError):
        make_e2e_row(status="ok", median_ms=1.0)
    with pytest.raises(ValueError):
        make_e2e_row(status="passed")
    assert set(E2E_STATUSES) == {"ok", "engine_error", "candidate_error", "timeout", "crashed", "skipped"}


def test_merge_fills_speedup_from_the_baseline_and_writes_the_json_schema(tmp_path):
    shards = []
    for i, row in enumerate(
        [
            _row("baseline", avg_latency_ms=100.0),
            _row("a.b", avg_latency_ms=80.0),
            _row("baseline", kind="throughput", total_tokens_per_s=200.0) | {"workload": "t"},
            _row("a.b", kind="throughput", total_tokens_per_s=300.0) | {"workload": "t"},
            _row("c.d", status="engine_error", error="boom (log: x.log)", log_path="x.log"),
        ]
    ):
        path = tmp_path / f"{i}.parquet"
        write_table(e2e_table([row]), path)
        shards.append(path)
    rows = merge_e2e(shards, tmp_path / "e2e.parquet", tmp_path / "e2e.json")
    by = {(r["workload"], r["variant"]): r for r in rows}
    assert by[("w", "a.b")]["speedup"] == pytest.approx(1.25)  # latency: baseline / candidate
    assert by[("t", "a.b")]["speedup"] == pytest.approx(1.5)  # throughput: candidate / baseline
    assert by[("w", "c.d")]["speedup"] is None
    doc = json.loads((tmp_path / "e2e.json").read_text())
    assert doc["tier"] == "e2e" and doc["schema_version"] == 2
    assert all(set(r) == set(E2E_COLUMNS) for r in doc["rows"])
    assert doc["summary"]["by_status"] == {"engine_error": 1, "ok": 4}
    assert pq.read_table(tmp_path / "e2e.parquet").schema.names == E2E_COLUMNS


def test_a_job_runs_its_pairs_in_abba_order_and_merges_them(tmp_path, monkeypatch):
    """The engine runs of one job (vLLM replaced by a stand-in that writes vLLM's latency
    JSON): pair 0 baseline first, pair 1 the variant first, ...; one row per run, each
    with its pair, vLLM's JSON of each run kept; the merge gives the ratio of the medians
    with a rerun interval. (The live tests run one pair: an engine start is the cost.)"""
    from kb_nano.e2e import job

    seen = []

    def fake_bench(model, tp, w, engine, env, bench_json, log_path):
        variant = "v" if json.loads(env[ENV_CANDIDATES]) else "baseline"
        latency = {"baseline": 0.010, "v": 0.008}[variant] * (1 + 0.01 * len(seen))  # a drifting host
        seen.append(variant)
        log_path.write_text("fake vLLM\n")
        pct = {str(q): latency for q in (10, 25, 50, 75, 90, 99)}
        bench_json.write_text(json.dumps({"avg_latency": latency, "latencies": [latency], "percentiles": pct}))
        return 0

    monkeypatch.setattr(job, "_run_bench", fake_bench)
    cand = {"id": "silu_and_mul/inplace", "path": str(REPO / "candidates/silu_and_mul/inplace.py"), "sha256": "x"}
    m = e2e_plan.model(TINY, REPO)
    model = {"key": m.key, "hub_id": None, "path": str(REPO / m.path), "tokenizer": str(REPO / m.tokenizer)}
    model |= {"load_format": m.load_format, "weights": m.weights}
    workload = {"name": "l", "kind": "latency", "input_len": 8, "output_len": 2, "batch_size": 1}
    workload |= {"num_iters_warmup": 0, "num_iters": 1}
    engine = {"dtype": "auto", "max_model_len": 128, "enforce_eager": True, "seed": 0, "device": "cpu"}
    monkeypatch.chdir(tmp_path)
    status = job.run(
        model=model,
        tp=1,
        workload=workload,
        variant="v",
        candidates=[cand],
        engine=engine | {"timeout_s": 60},
        output=str(tmp_path / "job.parquet"),
        vllm_json=str(tmp_path / "vllm.json"),
        log=str(tmp_path / "job.log"),
        pairs=3,
    )
    assert status == "ok" and seen == ["baseline", "v", "v", "baseline", "baseline", "v"]
    runs = json.loads((tmp_path / "vllm.json").read_text())["runs"]
    assert [(r["variant"], r["pair"]) for r in runs] == [
        ("baseline", 0), ("v", 0), ("v", 1), ("baseline", 1), ("baseline", 2), ("v", 2)
    ]  # fmt: skip
    rows = merge_e2e([tmp_path / "job.parquet"], tmp_path / "e2e.parquet", tmp_path / "e2e.json")
    (row,) = [r for r in rows if r["variant"] == "v"]
    lat = {(r["variant"], r["pair"]): 1000 * r["vllm"]["avg_latency"] for r in runs}
    assert json.loads(row["pair_speedups"]) == pytest.approx([lat[("baseline", p)] / lat[("v", p)] for p in range(3)])
    assert row["num_pairs"] == 3 and row["speedup_ci_low"] <= row["speedup"] <= row["speedup_ci_high"]


def test_merge_combines_the_pairs_into_a_ratio_with_a_rerun_interval(tmp_path):
    """A job's shard holds one row per run; the merge makes one row per variant: metrics
    the median over the pairs, speedup the ratio of those medians, Tier 1's rerun
    interval over the pairs (Student's t: wide with few pairs), each pair's own ratio
    listed, ``significant`` when the interval excludes 1; a failed pair fails the row."""
    base_ms, cand_ms = [100.0, 130.0, 90.0], [80.0, 100.0, 75.0]  # ratios 1.25, 1.3, 1.2
    runs = [_row("baseline", avg_latency_ms=b, pair=p) for p, b in enumerate(base_ms)]
    runs += [_row("a.b", avg_latency_ms=c, pair=p) for p, c in enumerate(cand_ms)]
    mixed = [_row("baseline", avg_latency_ms=100.0, pair=p) | {"workload": "m"} for p in range(3)]
    mixed += [_row("a.b", avg_latency_ms=c, pair=p) | {"workload": "m"} for p, c in enumerate([90.0, 110.0, 95.0])]
    failed = [_row("baseline", avg_latency_ms=100.0, pair=0) | {"workload": "f"}]
    failed += [_row("a.b", status="candidate_error", error="boom", pair=0) | {"workload": "f"}]
    path = tmp_path / "job.parquet"
    write_table(e2e_table(runs + mixed + failed), path)
    rows = merge_e2e([path], tmp_path / "e2e.parquet", tmp_path / "e2e.json")
    by = {(r["workload"], r["variant"]): r for r in rows}
    cand, base = by[("w", "a.b")], by[("w", "baseline")]
    assert len(rows) == 6 and cand["pair"] is None and cand["num_pairs"] == base["num_pairs"] == 3
    assert base["avg_latency_ms"] == 100.0 and cand["avg_latency_ms"] == 80.0  # medians
    assert cand["speedup"] == pytest.approx(100.0 / 80.0)  # the ratio of the medians, as in Tier 1
    assert json.loads(cand["pair_speedups"]) == pytest.approx([1.25, 1.3, 1.2])
    lo, hi = stats.speedup_interval([100.0, 130.0, 90.0], [80.0, 100.0, 75.0], 1.25)
    assert (cand["speedup_ci_low"], cand["speedup_ci_high"]) == pytest.approx((lo, hi))
    assert 1.0 < lo < 1.2 and 1.3 < hi  # t = 4.3 with 3 pairs: wider than the pairs' range
    assert cand["significant"] is True and base["speedup"] == 1.0 and base["speedup_ci_low"] is None
    assert by[("m", "a.b")]["significant"] is False  # ratios 1.11, 0.91, 1.05: the interval holds 1
    assert by[("f", "a.b")]["status"] == "candidate_error" and by[("f", "a.b")]["speedup"] is None
    # two pairs on one side of 1 by chance (0.890x and 0.868x, a loaded host) are not
    # significant: a percentile bootstrap over them spanned only 0.868-0.890
    two = [_row("baseline", avg_latency_ms=b, pair=p) | {"workload": "t"} for p, b in enumerate([100.0, 100.0])]
    two += [_row("a.b", avg_latency_ms=c, pair=p) | {"workload": "t"} for p, c in enumerate([112.38, 115.14])]
    write_table(e2e_table(two), path)
    (_, row) = merge_e2e([path], tmp_path / "e2e.parquet", tmp_path / "e2e.json")
    assert row["significant"] is False and row["speedup_ci_low"] < 0.87 and row["speedup_ci_high"] > 1.0


def test_cli_rejects_bad_e2e_input(tmp_path):
    work = copy_workflow(tmp_path)
    proc = kb_nano(work, "e2e", "latency", "--candidates", "attention/gqa_grouped", "-n")
    assert proc.returncode == 2 and proc.stderr.startswith("error: --candidates: attention/gqa_grouped")
    proc = kb_nano(work, "e2e", "latency", "-n")  # no Tier-1 results: nothing to compare the baseline with
    assert proc.returncode == 2 and proc.stderr.startswith("error: e2e: no candidate that vLLM can run passed Tier 1")
    assert proc.stderr.count("\n") == 1 and "--baseline measures the baseline alone" in proc.stderr
    proc = kb_nano(work, "e2e", "latency", "--batch-size", "0", "-n")
    assert proc.returncode == 2 and "batch_size must be a positive integer" in proc.stderr
    for value in ("0", "-1"):  # before anything else is printed, naming the flag
        proc = kb_nano(work, "e2e", "latency", "--pairs", value, "-n")
        assert (
            proc.returncode == 2 and not proc.stdout and "argument --pairs: must be a positive integer" in proc.stderr
        )


# ----------------------------------------------------------------------------- MLflow


def test_e2e_mlflow_run_is_keyed_by_its_rows(tmp_path):
    from kb_nano import tracking

    vllm_json = tmp_path / "results/e2e/tiny-llama/tp1/w/a.b.json"
    vllm_json.parent.mkdir(parents=True)
    vllm_json.write_text(json.dumps({"avg_latency": 0.08}))
    rows = [
        _row("baseline", avg_latency_ms=100.0),
        _row(
            "a.b+c.d",
            avg_latency_ms=80.0,
            candidates="a/b,c/d",
            vllm_json=str(vllm_json),
            candidate_sha256=json.dumps({"a/b": "1", "c/d": "2"}),
        ),
    ]
    shards = []
    for i, r in enumerate(rows):
        shards.append(tmp_path / f"{i}.parquet")
        write_table(e2e_table([r]), shards[-1])
    merge_e2e(shards, tmp_path / "e2e.parquet", tmp_path / "e2e.json")
    uri = "sqlite:///" + str(tmp_path / "mlflow.db")
    kw = dict(parquet=tmp_path / "e2e.parquet", json_path=tmp_path / "e2e.json", tracking_uri=uri, root=tmp_path)
    first = tracking.log_e2e(**kw)
    again = tracking.log_e2e(**kw)
    assert first["created"] and not again["created"] and again["run_id"] == first["run_id"]
    run = tracking.client(uri).get_run(first["run_id"])
    assert run.data.metrics["geomean_speedup"] == pytest.approx(1.25)
    assert run.data.metrics["speedup/tiny-llama/tp1/w/a.b c.d"] == pytest.approx(1.25)  # '+' is not allowed
    assert run.data.tags["kb_nano.candidate.c/d"] == "2" and first["experiment"] == "kb_nano/e2e"
    # A re-measured variant (new row) is a new run.
    write_table(e2e_table([{**rows[1], "avg_latency_ms": 90.0}]), shards[1])
    merge_e2e(shards, tmp_path / "e2e.parquet", tmp_path / "e2e.json")
    assert tracking.log_e2e(**kw)["created"]


def test_job_env_drops_snakemake_thread_counts(monkeypatch):
    from kb_nano.e2e.job import SNAKEMAKE_THREAD_VARS, job_env

    for var in SNAKEMAKE_THREAD_VARS:
        monkeypatch.setenv(var, "2")  # what Snakemake sets for a job with threads: 2
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    env = job_env([{"id": "a/b", "path": "/x.py"}], "/calls", "cpu")
    assert not set(SNAKEMAKE_THREAD_VARS) & set(env)
    assert env["VLLM_PLUGINS"] == "kb_nano" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert json.loads(env[ENV_CANDIDATES]) == [{"id": "a/b", "path": "/x.py"}] and env[ENV_CALLS_DIR] == "/calls"
