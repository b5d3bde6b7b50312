"""Tier 2 with real vLLM on the CPU: the plugin swap (call counters, a wrong candidate changes
greedy tokens while correct candidates reproduce the baseline's), the Snakemake path, and
failure rows."""

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
from workflow_helpers import REPO, TINY, copy_workflow, kb_nano

from kb_nano.config import load
from kb_nano.e2e import plan as e2e_plan
from kb_nano.e2e.vllm_plugin import ENV_CALLS_DIR, ENV_CANDIDATES

HAVE_VLLM = __import__("importlib").util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM not installed (pip install -e '.[e2e]')")
TEST_CANDS = Path(__file__).resolve().parent / "candidates"


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
    # each engine run says on the console when it starts and how it ended (each takes minutes)
    out = proc.stdout + proc.stderr
    assert f": {variant}, run 2 of 2 started (log: " in out and f": {variant}, run 2 of 2: ok in " in out, out
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
