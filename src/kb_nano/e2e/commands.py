"""vLLM's command lines for a Tier-2 job (engine flags, ``vllm bench``, ``vllm serve`` and
its client) and the wait for a server's ``/health``: what :mod:`kb_nano.e2e.job` runs."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kb_nano.e2e.schema import PERCENTILES, SERVE_METRICS
from kb_nano.e2e.workloads import Workload, bench_args

VLLM = [sys.executable, "-m", "kb_nano.e2e.vllm_cli"]


def engine_args(model: dict, tp: int, engine: dict) -> list[str]:
    """vLLM engine flags of a job (``--tokenizer``, ``--load-format``, TP, seed, dtype,
    ``--max-model-len``, ``--enforce-eager``); ``model``: ``path``, ``tokenizer``,
    ``load_format``; ``engine``: ``dtype``, ``max_model_len``, ``enforce_eager``, ``seed``."""
    cmd = [
        "--tokenizer",
        str(model["tokenizer"]),
        "--load-format",
        model["load_format"],
        "--tensor-parallel-size",
        str(tp),
        "--seed",
        str(engine["seed"]),
        "--dtype",
        str(engine["dtype"]),
    ]
    if engine.get("max_model_len"):
        cmd += ["--max-model-len", str(engine["max_model_len"])]
    if engine.get("enforce_eager"):
        cmd += ["--enforce-eager"]
    return cmd


def bench_command(model: dict, tp: int, workload: Workload, engine: dict, output_json: str) -> list[str]:
    """The ``vllm bench throughput|latency`` command line (argv) of one job."""
    return [
        *VLLM,
        "bench",
        workload.kind,
        "--model",
        str(model["path"]),
        *engine_args(model, tp, engine),
        *bench_args(workload),
        "--output-json",
        output_json,
    ]


def serve_commands(
    model: dict, tp: int, workload: Workload, engine: dict, port: int, result: Path
) -> tuple[list, list]:
    """``(vllm serve ..., vllm bench serve ...)`` of a serve job: the server on
    127.0.0.1:``port`` with the engine flags; the client with the workload's flags, the
    TTFT/TPOT/ITL/E2EL percentiles 10..99 and ``--save-result`` into ``result``."""
    server = [
        *VLLM,
        "serve",
        str(model["path"]),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *engine_args(model, tp, engine),
    ]
    client = [
        *VLLM,
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--model",
        str(model["path"]),
        "--tokenizer",
        str(model["tokenizer"]),
        "--seed",
        str(engine["seed"]),
        *bench_args(workload),
        "--percentile-metrics",
        ",".join(SERVE_METRICS),
        "--metric-percentiles",
        ",".join(str(q) for q in PERCENTILES),
        "--save-result",
        "--result-dir",
        str(result.parent),
        "--result-filename",
        result.name,
    ]
    return server, client


def free_port() -> int:

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, port: int, deadline: float) -> int | None:
    """Poll ``/health`` until it answers 200 (returns None), the server exits (returns its
    status) or ``deadline`` (``time.monotonic()``) passes (raises ``TimeoutError``)."""

    while True:
        code = proc.poll()
        if code is not None:
            return code
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                if resp.status == 200:
                    return None
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError
        time.sleep(1.0)


# Thread-count variables Snakemake sets to a job's `threads` for script jobs
# (snakemake/shell.py). vLLM on a CPU pins its own OpenMP threads per worker
# (VLLM_CPU_OMP_THREADS_BIND, default: all cores but VLLM_CPU_NUM_OF_RESERVED_CPU); with
# OMP_NUM_THREADS=2 inherited it ran 2 spinning threads on the 1 core it had pinned, and
# `vllm bench latency` took 3.3-4.0 s instead of 0.08-0.10 s per batch (2-core AMD EPYC,
# bench/e2e_harness_overhead.py). The job removes them so vLLM starts as from a shell.
