"""Tier 2 (vLLM end to end): workloads, planning, rows/JSON schema, merge, and real vLLM on
the CPU: the plugin swap (call counters, a wrong candidate changes greedy tokens while
correct candidates reproduce the baseline's), the Snakemake path, and failure rows."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from workflow_helpers import REPO, copy_workflow, kb_nano

from kb_nano import stats
from kb_nano.config import load
from kb_nano.e2e import plan as e2e_plan
from kb_nano.e2e import workloads
from kb_nano.e2e.merge import merge_e2e
from kb_nano.e2e.schema import E2E_COLUMNS, E2E_STATUSES, e2e_table, make_e2e_row
from kb_nano.e2e.vllm_plugin import ENV_CALLS_DIR, ENV_CANDIDATES, swappable
from kb_nano.errors import KbNanoError
from kb_nano.rows import write_table

HAVE_VLLM = __import__("importlib").util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM not installed (pip install -e '.[e2e]')")
TINY = "config/models/kb-nano/tiny-llama"
TEST_CANDS = Path(__file__).resolve().parent / "candidates"


# ----------------------------------------------------------------------------- workloads


def test_workload_flags_are_vllm_flags():
    w = workloads.from_flags("latency", None, input_len=8, output_len=4, batch_size=2, num_iters=2)
    assert w.name == "latency_in8_out4_bs2_warm1_it2"
    assert workloads.bench_args(w) == [
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--batch-size",
        "2",
        "--num-iters-warmup",
        "1",
        "--num-iters",
        "2",
    ]
    t = workloads.from_flags("throughput", None, input_len=64, output_len=8, num_prompts=5)
    assert workloads.bench_args(t) == [
        "--dataset-name",
        "random",
        "--random-input-len",
        "64",
        "--random-output-len",
        "8",
        "--random-range-ratio",
        "0.0",
        "--num-prompts",
        "5",
    ]
    s = workloads.from_flags("serve", None, input_len=16, num_prompts=4, max_concurrency=2)
    assert s.name == "serve_random_in16_out16_n4_r0.0_rateinf_c2"
    assert workloads.bench_args(s)[-4:] == ["--num-prompts", "4", "--max-concurrency", "2"]  # no --request-rate: inf


def test_workload_errors_are_one_line():
    with pytest.raises(KbNanoError, match="kind must be one of"):
        workloads.from_dict({"name": "x", "kind": "prefill"})
    with pytest.raises(KbNanoError, match="unknown workload field"):
        workloads.from_dict({"name": "x", "kind": "latency", "input_length": 3})
    with pytest.raises(KbNanoError, match="batch_size must be a positive integer"):
        workloads.from_dict({"name": "x", "kind": "latency", "batch_size": 0})


# ----------------------------------------------------------------------------- planning


def _tier1(work: Path, rows: list[dict]) -> None:
    """Write ``rows`` as the workflow's merged Tier-1 results, each measured with its
    candidate file as it is now (``candidate_sha256``)."""
    from kb_nano.candidates import file_sha256
    from kb_nano.kernels.schema import to_table

    for r in rows:
        r["candidate_sha256"] = file_sha256(work / "candidates" / f"{r['candidate']}.py")
    (work / "results").mkdir(exist_ok=True)
    write_table(to_table(rows), work / "results/kernels.parquet")


def test_default_candidate_set_is_the_fastest_that_passed_tier1(tmp_path):
    """Without --candidates the variant swaps in, per target vLLM can swap and the model
    uses, the candidate that passed Tier 1 fastest on the device: a new candidate file
    changes nothing until Tier 1 measured it, and a candidate that failed there (an
    import_error, one incorrect row) is never picked, however fast its other rows."""
    from tracking_helpers import row

    work = copy_workflow(tmp_path)
    assert e2e_plan.candidate_set(work, [], "cpu", [TINY]) == []  # no Tier-1 results yet
    assert "run `kb_nano kernels` first" in e2e_plan.describe_choice(work, "cpu", [], [TINY])
    (work / "candidates/rms_norm/zz_copy.py").write_bytes((work / "candidates/rms_norm/torch_fused.py").read_bytes())
    rows = [
        row("rms_norm", "torch_fused", speedup=1.5),
        row("rms_norm", "torch_fused", n=64, speedup=1.2),
        row("rms_norm", "triton_rowwise", speedup=9.0, device="cuda"),  # another device
        row("silu_and_mul", "inplace", speedup=0.9),  # slower than the baseline, but the only one that passed
        row("fused_add_rms_norm", "fp32_sum", speedup=2.0),
        row("fused_add_rms_norm", "fp32_sum", n=64, status="incorrect"),
        row("rotary_embedding", "rotate_half", status="import_error"),
        row("gelu_and_mul", "inplace", speedup=1.1),  # Llama has no GeGLU
    ]
    _tier1(work, rows)
    cands = e2e_plan.candidate_set(work, [], "cpu", [TINY])
    assert [c.id for c in cands] == ["rms_norm/torch_fused", "silu_and_mul/inplace"]
    assert all(swappable(c.target)[0] for c in cands)
    line = e2e_plan.describe_choice(work, "cpu", cands, [TINY])
    assert "rms_norm/torch_fused (1.34x over 2 rows)" in line and "silu_and_mul/inplace (0.9x over 1 rows)" in line
    assert "gelu_and_mul/inplace" in [c.id for c in e2e_plan.candidate_set(work, [], "cpu", ["gemma2-2b"])]
    _tier1(work, [*rows, row("rms_norm", "zz_copy", speedup=1.8)])  # Tier 1 measured the new file: faster
    ids = [c.id for c in e2e_plan.candidate_set(work, [], "cpu", [TINY])]
    assert ids == ["rms_norm/zz_copy", "silu_and_mul/inplace"]
    # the file edited since: its rows are stale, the runner-up is swapped in
    (work / "candidates/rms_norm/zz_copy.py").write_text((work / "candidates/rms_norm/zz_copy.py").read_text() + "#\n")
    ids = [c.id for c in e2e_plan.candidate_set(work, [], "cpu", [TINY])]
    assert ids == ["rms_norm/torch_fused", "silu_and_mul/inplace"]
    name = e2e_plan.variant_name(cands)
    assert [c.id for c in e2e_plan.variant_candidates(name, work)] == [c.id for c in cands]
    (work / "candidates/rms_norm/torch_fused.py").unlink()  # no candidate of rms_norm has current rows now
    assert [c.id for c in e2e_plan.candidate_set(work, [], "cpu", [TINY])] == ["silu_and_mul/inplace"]


def test_unswappable_candidate_is_refused_with_the_reason():
    with pytest.raises(
        KbNanoError, match="attention/gqa_grouped: not swappable into vLLM: vLLM attention is a backend"
    ):
        e2e_plan.candidate_set(REPO, ["attention/gqa_grouped"], "cpu")
    with pytest.raises(KbNanoError, match="supports cuda; this run is on cpu"):
        e2e_plan.candidate_set(REPO, ["rms_norm/triton_rowwise"], "cpu")


def test_model_without_weights_runs_with_random_weights():
    m = e2e_plan.model(TINY, REPO)
    assert (m.key, m.load_format, m.weights) == ("tiny-llama", "dummy", "random (--load-format dummy)")
    assert m.tokenizer == Path(TINY)
    hub = e2e_plan.model("llama31-8b", REPO)  # vendored config only: embedded tokenizer
    assert hub.tokenizer == e2e_plan.EMBEDDED_TOKENIZER and hub.load_format == "dummy"


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
    proc = kb_nano(work, "e2e", "latency", "--batch-size", "0", "-n")
    assert proc.returncode == 2 and "batch_size must be a positive integer" in proc.stderr
    for value in ("0", "-1"):  # before anything else is printed, naming the flag
        proc = kb_nano(work, "e2e", "latency", "--pairs", value, "-n")
        assert (
            proc.returncode == 2 and not proc.stdout and "argument --pairs: must be a positive integer" in proc.stderr
        )


# ----------------------------------------------------------------------------- real vLLM


def _greedy(tmp_path: Path, name: str, candidates: list[dict]) -> tuple[list, dict]:
    out, calls = tmp_path / f"{name}.json", tmp_path / f"calls-{name}"
    calls.mkdir()
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_PLUGINS": "kb_nano",
        ENV_CANDIDATES: json.dumps(candidates),
        ENV_CALLS_DIR: str(calls),
    }
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests/e2e/vllm_greedy.py"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    totals: dict = {}
    for f in calls.glob("calls-*.json"):
        for cid, n in json.loads(f.read_text())["calls"].items():
            totals[cid] = totals.get(cid, 0) + n
    return json.loads(out.read_text()), totals


@needs_vllm
@pytest.mark.slow
def test_plugin_swaps_candidates_into_vllm(tmp_path):
    """Correct candidates run inside the engine (counters) and give the baseline's greedy
    tokens; a sign-flipped fused_add_rms_norm gives other tokens."""
    correct = [
        {"id": cid, "path": str(REPO / "candidates" / f"{cid}.py")}
        for cid in (
            "rms_norm/torch_fused",
            "fused_add_rms_norm/fp32_sum",
            "silu_and_mul/inplace",
            "rotary_embedding/rotate_half",
        )
    ]
    base_tokens, base_calls = _greedy(tmp_path, "baseline", [])
    assert base_calls == {}
    good_tokens, good_calls = _greedy(tmp_path, "correct", correct)
    # 3 prompts x 8 tokens, 4 layers: every candidate served eager forward calls in the worker.
    assert set(good_calls) == {c["id"] for c in correct} and min(good_calls.values()) >= 8, good_calls
    assert good_tokens == base_tokens
    wrong = [{"id": "fused_add_rms_norm/sign_flip", "path": str(TEST_CANDS / "sign_flip_fused_add_rms_norm.py")}]
    wrong_tokens, wrong_calls = _greedy(tmp_path, "wrong", wrong)
    assert wrong_calls["fused_add_rms_norm/sign_flip"] >= 8
    assert wrong_tokens != base_tokens


def _sockets_in_tempdir() -> set[str]:
    """Names of the Unix socket files directly in the system temp dir."""
    root = Path(tempfile.gettempdir())
    return {p.name for p in root.iterdir() if stat.S_ISSOCK(p.lstat().st_mode)}


@needs_vllm
@pytest.mark.slow
def test_kb_nano_e2e_latency_runs_baseline_and_candidates(tmp_path):
    work = copy_workflow(tmp_path)
    sockets = _sockets_in_tempdir()
    args = (
        "e2e",
        "latency",
        "--input-len",
        "16",
        "--output-len",
        "4",
        "--batch-size",
        "2",
        "--num-iters-warmup",
        "0",
        "--num-iters",
        "2",
        "--candidates",
        "rms_norm/torch_fused",
        "silu_and_mul/inplace",
        "--pairs",
        "1",
        "--output-json",
        "results/my_e2e.json",
    )
    proc = kb_nano(work, *args)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads((work / "results/my_e2e.json").read_text())
    rows = {r["variant"]: r for r in doc["rows"]}
    variant = "rms_norm.torch_fused+silu_and_mul.inplace"
    assert set(rows) == {"baseline", variant}
    assert all(r["status"] == "ok" and r["avg_latency_ms"] > 0 for r in rows.values())
    calls = json.loads(rows[variant]["candidate_calls"])
    assert calls["rms_norm/torch_fused"]["calls"] > 0 and calls["silu_and_mul/inplace"]["calls"] > 0
    assert json.loads(rows["baseline"]["candidate_calls"]) == {}
    # one pair (the order of more: test_a_job_runs_its_pairs_in_abba_order_and_merges_them):
    # the speedup is the ratio of the two runs' latencies; one pair has no interval
    runs = json.loads(Path(work / rows[variant]["vllm_json"]).read_text())["runs"]
    assert [(r["variant"], r["pair"]) for r in runs] == [("baseline", 0), (variant, 0)]
    assert all(set(r["vllm"]) >= {"avg_latency", "latencies", "percentiles"} for r in runs)  # vLLM's own JSON
    lat = {r["variant"]: 1000 * r["vllm"]["avg_latency"] for r in runs}
    assert rows[variant]["speedup"] == pytest.approx(lat["baseline"] / lat[variant], rel=1e-6)
    assert rows[variant]["num_pairs"] == rows["baseline"]["num_pairs"] == 1
    assert "95% interval" in proc.stdout
    assert "random (--load-format dummy)" in proc.stdout and "speedup" in proc.stdout
    assert (work / "results/mlflow/e2e.json").is_file()
    assert _sockets_in_tempdir() <= sockets, "vLLM's ZMQ socket files were left in the temp dir"
    # Editing one candidate reruns only the variant that holds it (and merge + MLflow).
    cand = work / "candidates/silu_and_mul/inplace.py"
    cand.write_text(cand.read_text() + "\n# edited by the e2e rerun test\n")
    dry = kb_nano(work, *args, "-n", "-v")
    assert dry.returncode == 0, dry.stderr[-3000:]
    jobs = [ln for ln in dry.stdout.splitlines() if "output: results/e2e/" in ln]
    assert len(jobs) == 1 and variant in jobs[0], dry.stdout[-3000:]


@needs_vllm
@pytest.mark.slow
def test_engine_failure_becomes_a_row(tmp_path):
    work = copy_workflow(tmp_path)
    broken = work / "config/models/kb-nano/broken"
    broken.mkdir()
    cfg = json.loads((work / TINY / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**cfg, "architectures": ["NoSuchModelForCausalLM"]}))
    (work / "e2e.yaml").write_text(
        yaml.safe_dump(
            {
                "e2e": {
                    **load(work)["e2e"],
                    "models": ["config/models/kb-nano/broken"],
                    "baseline_only": True,
                }
            }
        )
    )
    proc = kb_nano(work, "e2e", "latency", "--configfile", "e2e.yaml", "--baseline", "--num-iters", "1", "--pairs", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads((work / "results/e2e.json").read_text())["rows"]
    assert row["status"] == "engine_error" and row["log_path"] in row["error"]
    assert row["num_pairs"] == 0 and len(json.loads(Path(work / row["vllm_json"]).read_text())["runs"]) == 1
    assert "NoSuchModelForCausalLM" in Path(work / row["log_path"]).read_text()


def _marked_processes(mark: str) -> list[int]:
    """Pids whose environment holds KB_NANO_TEST_MARK=mark (vLLM renames its engine and
    worker processes, so the command line cannot find them; the environment can)."""
    pids = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"KB_NANO_TEST_MARK={mark}".encode() in env.read_bytes().split(b"\0"):
                pids.append(int(env.parent.name))
        except OSError:
            continue
    return pids


def _job(tmp_path, candidates, timeout_s=600):
    from kb_nano.e2e.job import run

    m = e2e_plan.model(TINY, REPO)
    model = {
        "key": m.key,
        "hub_id": None,
        "path": str(REPO / m.path),
        "tokenizer": str(REPO / m.tokenizer),
        "load_format": m.load_format,
        "weights": m.weights,
    }
    status = run(
        model=model,
        tp=1,
        workload={
            "name": "l",
            "kind": "latency",
            "input_len": 8,
            "output_len": 2,
            "batch_size": 1,
            "num_iters_warmup": 0,
            "num_iters": 1,
        },
        variant="v",
        candidates=candidates,
        engine={
            "dtype": "auto",
            "max_model_len": 128,
            "enforce_eager": True,
            "seed": 0,
            "device": "cpu",
            "timeout_s": timeout_s,
        },
        output=str(tmp_path / "row.parquet"),
        vllm_json=str(tmp_path / "vllm.json"),
        log=str(tmp_path / "job.log"),
    )
    row = pq.read_table(tmp_path / "row.parquet").to_pylist()[-1]  # the run that ended the job
    assert row["status"] == status
    return row


@needs_vllm
@pytest.mark.slow
def test_candidate_crash_inside_the_engine_becomes_a_row(tmp_path):
    cand = {"id": "silu_and_mul/raises", "path": str(TEST_CANDS / "raises_silu_and_mul.py"), "sha256": "x"}
    row = _job(tmp_path, [cand])
    assert row["status"] == "candidate_error"
    assert "silu_and_mul/raises failed (forward): RuntimeError: kb-nano test: deliberate failure" in row["error"]
    assert row["variant"] == "v" and str(tmp_path / "job/v.pair0.log") in row["error"]
    runs = json.loads((tmp_path / "vllm.json").read_text())["runs"]
    assert [(r["variant"], r["status"]) for r in runs] == [("baseline", "ok"), ("v", "candidate_error")]


@needs_vllm
@pytest.mark.slow
def test_timeout_becomes_a_row_and_leaves_no_process(tmp_path, monkeypatch):
    monkeypatch.setenv("KB_NANO_TEST_MARK", tmp_path.name)
    row = _job(tmp_path, [], timeout_s=15)
    assert row["status"] == "timeout" and "timeout_s=15" in row["error"]
    assert _marked_processes(tmp_path.name) == []  # no engine process outlived the job


@needs_vllm
@pytest.mark.slow
def test_serve_reports_ttft_tpot_itl_and_stops_the_server(tmp_path, monkeypatch):
    monkeypatch.setenv("KB_NANO_TEST_MARK", tmp_path.name)
    cand = {"id": "silu_and_mul/inplace", "path": str(REPO / "candidates/silu_and_mul/inplace.py"), "sha256": "x"}
    from kb_nano.e2e.job import run

    m = e2e_plan.model(TINY, REPO)
    model = {
        "key": m.key,
        "hub_id": None,
        "path": str(REPO / m.path),
        "tokenizer": str(REPO / m.tokenizer),
        "load_format": m.load_format,
        "weights": m.weights,
    }
    status = run(
        model=model,
        tp=1,
        workload={
            "name": "s",
            "kind": "serve",
            "random_input_len": 16,
            "random_output_len": 4,
            "num_prompts": 4,
            "max_concurrency": 2,
        },
        variant="v",
        candidates=[cand],
        engine={
            "dtype": "auto",
            "max_model_len": 128,
            "enforce_eager": True,
            "seed": 0,
            "device": "cpu",
            "timeout_s": 600,
        },
        output=str(tmp_path / "row.parquet"),
        vllm_json=str(tmp_path / "vllm.json"),
        log=str(tmp_path / "job.log"),
    )
    base, row = pq.read_table(tmp_path / "row.parquet").to_pylist()  # pair 0: the baseline first
    assert (base["variant"], base["pair"], row["variant"], row["pair"]) == ("baseline", 0, "v", 0)
    assert status == "ok", row["error"]
    assert row["num_requests"] == 4 and row["failed_requests"] == 0
    for key in (
        "mean_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "mean_itl_ms",
        "mean_e2el_ms",
        "requests_per_s",
        "output_tokens_per_s",
    ):
        assert row[key] > 0, key
    assert json.loads(row["candidate_calls"])["silu_and_mul/inplace"]["calls"] > 0  # in the server's engine
    runs = json.loads((tmp_path / "vllm.json").read_text())["runs"]
    assert [r["variant"] for r in runs] == ["baseline", "v"]
    assert "p99_e2el_ms" in runs[1]["vllm"]  # vLLM's own result
    assert "v pair 0: ok" in (tmp_path / "job.log").read_text()
    assert "kb_nano.e2e.vllm_cli serve" in Path(row["log_path"]).read_text()
    assert _marked_processes(tmp_path.name) == []  # the server and its engine were stopped


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
