"""Shared helpers of the tracking/history/report and table tests: synthetic merged result
sets (real kernel-row schema, written the way the merge writes them; merged Tier-2 rows),
a real MLflow server subprocess on 127.0.0.1, and the column headers of printed rich tables."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kb_nano.e2e.schema import PERCENTILES, make_e2e_row
from kb_nano.kernels.merge import summarize
from kb_nano.kernels.schema import make_row, to_table
from kb_nano.rows import json_rows, write_table


def row(
    target: str,
    cand: str,
    model: str = "llama31-8b",
    tp: int = 1,
    n: int = 1,
    status: str = "passed",
    speedup: float | None = 1.25,
    device: str = "cpu",
    device_name: str = "Test CPU",
    **extra,
) -> dict:
    """One kernel row; ``cand`` is the candidate name (id = ``target/cand``)."""
    base_ms = 0.02
    passed = status == "passed"
    return make_row(
        scenario_id=f"{target}__{model}__tp{tp}__n{n}",
        target=target,
        level=1,
        category="norm",
        model=model,
        tp=tp,
        num_tokens=n,
        dtype="bfloat16",
        candidate=f"{target}/{cand}",
        candidate_sha256="0" * 64,
        status=status,
        error=None if passed else f"{status} for the test",
        baseline_ms=base_ms if passed else None,
        candidate_ms=base_ms / speedup if passed and speedup else None,
        speedup=speedup if passed else None,
        bytes_moved=24576,
        flops=16384,
        num_warmup=1,
        num_runs=5,
        device=device,
        device_name=device_name,
        torch_version="2.13.0+cpu",
        kb_nano_version="0.1.0",
        git_sha="abc123",
        created_at="2026-01-01T00:00:00+00:00",
        **extra,
    )


def result_set(root: Path, rows: list[dict], manifest_text: str = "schema_version: 1\nscenarios: []\n") -> dict:
    """Write ``rows`` as results/kernels.parquet + kernels.json, a manifest and the
    candidate files under ``root``; returns the keyword arguments of
    ``kb_nano.tracking.log_kernels`` (without tracking_uri)."""
    root = Path(root)
    results = root / "results"
    results.mkdir(parents=True, exist_ok=True)
    write_table(to_table(rows), results / "kernels.parquet")
    clean = json_rows(rows)
    doc = {"schema_version": 1, "tier": "kernels", "summary": summarize(clean), "rows": clean}
    (results / "kernels.json").write_text(json.dumps(doc))
    (results / "inputs").mkdir(exist_ok=True)
    (results / "inputs" / "llm.yaml").write_text(manifest_text)
    for cid in {r["candidate"] for r in rows}:
        path = root / "candidates" / f"{cid}.py"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"# candidate {cid}\n")
    return {
        "parquet": results / "kernels.parquet",
        "json_path": results / "kernels.json",
        "manifest": results / "inputs" / "llm.yaml",
        "plots": [],
        "root": root,
        "config": {"num_warmup": 1, "num_runs": 5, "models": ["llama31-8b"]},
        "marker": results / "mlflow" / "kernels.json",
    }


LATENCY, THROUGHPUT, SERVE = (
    "latency_in32_out8_bs2_warm1_it2",
    "throughput_random_in32_out8_n4",
    "serve_random_in32_out8_n4_c2",
)
WORKLOAD_SETTINGS = {"input_len": 32, "output_len": 8, "batch_size": 2, "num_prompts": 4, "max_concurrency": 2}
E2E_CANDIDATES = "rms_norm/torch_fused,silu_and_mul/inplace"
E2E_CALLS = {"rms_norm/torch_fused": {"constructed": 1, "calls": 68}, "silu_and_mul/inplace": {"constructed": 0}}


def e2e_row(kind: str, workload: str, variant: str, status: str = "ok", **fields) -> dict:
    """One merged e2e row (as :func:`kb_nano.e2e.merge.merge_e2e` writes it) of tiny-llama
    at TP 1: ``variant`` "baseline", or any other value for ``E2E_CANDIDATES`` with the
    plugin's call counts."""
    baseline = variant == "baseline"
    return make_e2e_row(
        model="tiny-llama",
        tp=1,
        workload=workload,
        kind=kind,
        workload_params=json.dumps({"name": workload, "kind": kind, **WORKLOAD_SETTINGS}),
        variant="baseline" if baseline else "rms_norm.torch_fused+silu_and_mul.inplace",
        candidates="" if baseline else E2E_CANDIDATES,
        candidate_calls=None if baseline else json.dumps(E2E_CALLS),
        status=status,
        weights="random (--load-format dummy)",
        num_pairs=3,
        speedup=1.0 if baseline else fields.pop("speedup", None),
        **fields,
    )


def e2e_rows() -> list[dict]:
    """A latency workload (with a candidate_error row), a throughput and a serve workload:
    every metric column of the three kinds."""
    latency = {"avg_latency_ms": 103.9, **{f"p{q}_latency_ms": 100.0 + q for q in PERCENTILES}}
    serve = {f"{st}_{m}_ms": 12.5 for m in ("ttft", "tpot", "itl", "e2el") for st in ("mean", "p50", "p90", "p99")}
    tokens = {"requests_per_s": 3.25, "total_tokens_per_s": 123.4, "output_tokens_per_s": 45.6}
    interval = {"speedup_ci_low": 0.325, "speedup_ci_high": 2.584, "significant": False}
    error = "rms_norm/torch_fused: RuntimeError: expected a tensor of dtype bfloat16 (log: results/logs/e2e/x.log)"
    return [
        e2e_row("latency", LATENCY, "baseline", **latency),
        e2e_row("latency", LATENCY, "cand", speedup=0.916, **latency, **interval),
        e2e_row("latency", LATENCY, "cand", status="candidate_error", error=error),
        e2e_row("throughput", THROUGHPUT, "baseline", **tokens),
        e2e_row("throughput", THROUGHPUT, "cand", speedup=1.118, **tokens, **interval),
        e2e_row("serve", SERVE, "baseline", **tokens, **serve),
        e2e_row("serve", SERVE, "cand", speedup=0.977, **tokens, **serve, **interval),
    ]


def table_headers(out: str) -> list[str]:
    """The column headers of each rich table in ``out``, one string per table: the words
    of each column (a header may wrap onto several lines) joined by spaces."""
    found, lines = [], out.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith("┏"):
            end = next(j for j in range(i, len(lines)) if lines[j].lstrip().startswith("┡"))
            cells = [ln.strip().strip("┃").split("┃") for ln in lines[i + 1 : end]]
            columns = [" ".join(" ".join(c[k] for c in cells).split()) for k in range(len(cells[0]))]
            found.append(" | ".join(columns))
    return found


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float = 90.0, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url`` until it answers 200; raise if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering {url}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer within {timeout_s} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group this test started (start_new_session=True), then SIGKILL."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


@contextlib.contextmanager
def mlflow_server(tmp: Path):
    """A real ``mlflow server`` on 127.0.0.1 (SQLite backend and proxied artifacts under
    ``tmp``); yields its URL; killed afterwards."""
    port = free_port()
    log = open(tmp / "mlflow-server.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{tmp / 'server.db'}",
            "--artifacts-destination",
            str(tmp / "server-artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=tmp,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", proc=proc)
        yield url
    finally:
        stop(proc)
        log.close()
