"""One Tier-2 job: model × TP × workload × variant -> vLLM's own benchmark, the baseline
and the variant alternately ``pairs`` times -> one row per run.

The job runs ``vllm bench throughput|latency`` (vLLM's CLI through
:mod:`kb_nano.e2e.vllm_cli`) in a child process with ``--output-json``, or for ``serve``
starts ``vllm serve`` on 127.0.0.1 (a free port), waits for ``/health`` and drives it
with ``vllm bench serve --save-result``; in every case with the kb-nano vLLM
plugin enabled (``VLLM_PLUGINS=kb_nano``) and the variant's candidate files named in
``KB_NANO_E2E_CANDIDATES`` (empty for the baseline, where the plugin does nothing). The
numbers are vLLM's; the harness adds the process start and the row. The child runs in a
session of its own; afterwards (finished, failed, timed out or interrupted) the whole
process group is killed (the server's too), so no server, engine core or worker process
outlives the job.

Status of the row (:data:`kb_nano.e2e.schema.E2E_STATUSES`): ``ok`` when vLLM wrote its JSON;
``candidate_error`` when the plugin recorded a candidate failure; ``timeout``; ``crashed``
when the benchmark died by a signal; ``engine_error`` otherwise. Every failed row names
the log. Torch-free.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import kb_nano
from kb_nano import gpus
from kb_nano.e2e.commands import bench_command, free_port, serve_commands, wait_healthy
from kb_nano.e2e.schema import PERCENTILES, SERVE_METRICS, e2e_table, make_e2e_row
from kb_nano.e2e.workloads import Workload
from kb_nano.files import atomic_write_text
from kb_nano.provenance import git_sha, package_version
from kb_nano.rows import write_table

_OUTPUT_TOKENS_RE = re.compile(r"Total num output tokens:\s+(\d+)")
_ERROR_LINE_RE = re.compile(r"(Error|Exception|error:)")


SNAKEMAKE_THREAD_VARS = (
    "OMP_NUM_THREADS",
    "GOTO_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


def job_env(candidates: list[dict], calls_dir: str, device: str) -> dict:
    """Environment of the benchmark process: the plugin's variables, ``VLLM_PLUGINS=kb_nano``,
    on CPU ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of KV cache) unless already set, and without
    :data:`SNAKEMAKE_THREAD_VARS` (steer vLLM's CPU threads with its own
    ``VLLM_CPU_OMP_THREADS_BIND`` / ``VLLM_CPU_NUM_OF_RESERVED_CPU``)."""
    from kb_nano.e2e.vllm_plugin import ENV_CALLS_DIR, ENV_CANDIDATES, PLUGIN_NAME

    env = {k: v for k, v in os.environ.items() if k not in SNAKEMAKE_THREAD_VARS}
    env["VLLM_PLUGINS"] = PLUGIN_NAME
    env[ENV_CANDIDATES] = json.dumps(candidates)
    env[ENV_CALLS_DIR] = calls_dir
    if device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def _evidence(calls_dir: Path) -> tuple[dict, dict | None]:
    """Plugin files -> ``({candidate: {constructed, calls}}, first error record or None)``."""
    totals: dict[str, dict[str, int]] = {}
    error = None
    for path in sorted(calls_dir.glob("calls-*.json")):
        with contextlib.suppress(OSError, ValueError):
            doc = json.loads(path.read_text())
            for key in ("constructed", "calls"):
                for cid, n in doc.get(key, {}).items():
                    totals.setdefault(cid, {"constructed": 0, "calls": 0})[key] += int(n)
    for path in sorted(calls_dir.glob("error-*.json")):
        with contextlib.suppress(OSError, ValueError):
            error = error or json.loads(path.read_text())
    return totals, error


def _last_error_line(log: Path) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    hits = [ln for ln in lines if _ERROR_LINE_RE.search(ln)]
    return (hits[-1] if hits else (lines[-1] if lines else ""))[:300]


def metrics(kind: str, result: dict, log_text: str) -> dict:
    """Row metrics from vLLM's ``--output-json`` (``--save-result`` for serve) document.

    serve: ``request_throughput``, ``total_token_throughput``, ``output_throughput``
    (per s), ``duration``, ``completed``, ``failed`` and ``{mean,p50,p90,p99}_{ttft,tpot,
    itl,e2el}_ms`` as vLLM names them.

    latency: ``avg_latency`` and ``percentiles`` (s) -> ``avg_latency_ms``, ``p{q}_latency_ms``.
    throughput: ``requests_per_second``, ``tokens_per_second`` (total), ``elapsed_time``,
    ``num_requests``, ``total_num_tokens``; output tokens/s = vLLM's printed
    ``Total num output tokens`` / ``elapsed_time`` (the same formula as its printed
    ``output tokens/s``; the JSON does not carry it)."""
    if kind == "serve":
        out = {
            "requests_per_s": float(result["request_throughput"]),
            "total_tokens_per_s": float(result["total_token_throughput"]),
            "output_tokens_per_s": float(result["output_throughput"]),
            "elapsed_s": float(result["duration"]),
            "num_requests": int(result["completed"]),
            "total_output_tokens": int(result["total_output_tokens"]),
            "failed_requests": int(result.get("failed", 0) or 0),
        }
        out["total_num_tokens"] = int(result["total_input_tokens"]) + out["total_output_tokens"]
        for m in SERVE_METRICS:
            for stat in ("mean", "p50", "p90", "p99"):
                value = result.get(f"{stat}_{m}_ms")
                out[f"{stat}_{m}_ms"] = None if value is None else float(value)
        return out
    if kind == "latency":
        out = {"avg_latency_ms": 1000.0 * float(result["avg_latency"])}
        for q in PERCENTILES:
            out[f"p{q}_latency_ms"] = 1000.0 * float(result["percentiles"][str(q)])
        return out
    elapsed = float(result["elapsed_time"])
    out = {
        "requests_per_s": float(result["requests_per_second"]),
        "total_tokens_per_s": float(result["tokens_per_second"]),
        "elapsed_s": elapsed,
        "num_requests": int(result["num_requests"]),
        "total_num_tokens": int(result["total_num_tokens"]),
    }
    m = _OUTPUT_TOKENS_RE.search(log_text)
    if m:
        out["total_output_tokens"] = int(m.group(1))
        out["output_tokens_per_s"] = int(m.group(1)) / elapsed
    return out


def run(
    *,
    model: dict,
    tp: int,
    workload: dict,
    variant: str,
    candidates: list[dict],
    engine: dict,
    output: str,
    vllm_json: str,
    log: str,
    pairs: int = 1,
) -> str:
    """Run one e2e job: ``pairs`` pairs of engine runs, the baseline and ``variant``
    alternately in ABBA order (pair 0 baseline first, pair 1 the variant first, ...), so
    a drift of the host over the job falls on both sides alike; a ``baseline`` job runs
    the baseline ``pairs`` times. It stops at the first failed run. Writes one row per
    run to ``output`` (Parquet, atomic; ``pair`` = the pair index) and to ``vllm_json``
    ``{"runs": [{"variant", "pair", "status", "error", "log", "vllm"}]}`` with vLLM's
    own JSON of each run; each run's log is ``<log without .log>/<variant>.pair<p>.log``,
    and ``log`` lists the runs. Returns the last run's status.

    ``model``: ``key``, ``hub_id``, ``path``, ``tokenizer``, ``load_format``, ``weights``.
    ``candidates``: ``[{"id", "path" (absolute), "sha256"}]`` ([] for the baseline).
    ``engine``: ``dtype``, ``max_model_len``, ``enforce_eager``, ``seed``, ``device``
    (cpu|cuda), ``timeout_s`` (seconds for each run's benchmark process)."""
    from kb_nano.e2e.workloads import from_dict

    w = from_dict(workload)
    log_path = Path(log)
    runs_dir = log_path.with_suffix("")
    runs_dir.mkdir(parents=True, exist_ok=True)
    sides = [("baseline", [])] + ([(variant, candidates)] if variant != "baseline" else [])
    abba = [sides if p % 2 == 0 else sides[::-1] for p in range(max(1, int(pairs)))]
    order = [(name, cands, p) for p, pair in enumerate(abba) for name, cands in pair]
    rows, docs, status = [], [], "ok"
    n_gpus = int(tp) if engine["device"] == "cuda" else 0
    # On GPUs the job leases tp concrete devices for its whole life (kb_nano.gpus): the
    # engine sees only those; a killed job frees them.
    with (
        gpus.lease(n_gpus, Path.cwd() / "results/.locks", float(engine["timeout_s"])) as gpu_ids,
        open(log_path, "w") as job_log,
    ):
        for i, (name, cands, p) in enumerate(order):
            run_log = runs_dir / f"{name}.pair{p}.log"
            # one line on the console per engine run: a run takes minutes (engine start, warm-up)
            what = f"kb-nano e2e: {model['key']} tp={tp} {w.name}: {name}, run {i + 1} of {len(order)}"
            print(f"{what} started (log: {run_log})", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            row, doc = _run_once(model, tp, w, name, cands, engine, gpu_ids, run_log)
            print(f"{what}: {row['status']} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            row.update(pair=p, vllm_json=str(vllm_json))
            rows.append(row)
            docs.append({"variant": name, "pair": p, **doc})
            status = row["status"]
            print(f"{name} pair {p}: {status} (log: {run_log})", file=job_log, flush=True)
            if status != "ok":
                break
    atomic_write_text(Path(vllm_json), json.dumps({"runs": docs}, indent=1) + "\n")
    write_table(e2e_table(rows), Path(output))
    return status


def _run_once(model, tp, w: Workload, variant: str, candidates: list[dict], engine: dict, gpu_ids, log_path: Path):
    """One engine run of ``variant`` -> ``(row fields, {"status", "error", "log", "vllm"})``."""
    t0 = time.perf_counter()
    status = error = None
    result: dict = {}
    with tempfile.TemporaryDirectory(prefix="kb_nano_e2e_") as tmp:
        bench_json = Path(tmp) / "bench.json"
        calls_dir = Path(tmp) / "calls"
        calls_dir.mkdir()
        env = job_env([{"id": c["id"], "path": c["path"]} for c in candidates], str(calls_dir), engine["device"])
        env["VLLM_RPC_BASE_PATH"] = tmp  # vLLM's ZMQ socket files: gone with the run's temp dir
        if gpu_ids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
        code = _run_bench(model, tp, w, engine, env, bench_json, log_path)
        calls, cand_error = _evidence(calls_dir)
        log_text = log_path.read_text(errors="replace")
        if code == 0 and bench_json.is_file():
            status = "ok"
            result = json.loads(bench_json.read_text())
        elif cand_error is not None:
            status = "candidate_error"
            error = f"candidate {cand_error['candidate']} failed ({cand_error['where']}): {cand_error['error']}"
        elif code is None:
            status = "timeout"
            error = f"exceeded e2e timeout_s={engine['timeout_s']}; every process of the job was killed"
        elif code < 0:
            status = "crashed"
            error = f"benchmark killed by signal {signal.Signals(-code).name}"
        else:
            status = "engine_error"
            what = "the vLLM server" if w.kind == "serve" and _SERVER_DIED in log_text else "vLLM"
            error = f"{what} exited with status {code}: {_last_error_line(log_path)}"
        if error:
            error += f" (log: {log_path})"
    row = make_e2e_row(
        model=model["key"],
        hub_id=model.get("hub_id"),
        model_path=str(model["path"]),
        weights=model["weights"],
        load_format=model["load_format"],
        tokenizer=str(model["tokenizer"]),
        tp=int(tp),
        workload=w.name,
        kind=w.kind,
        workload_params=json.dumps(w.params(), sort_keys=True),
        variant=variant,
        candidates=",".join(c["id"] for c in candidates),
        candidate_sha256=json.dumps({c["id"]: c["sha256"] for c in candidates}, sort_keys=True),
        candidate_calls=json.dumps(calls, sort_keys=True),
        status=status,
        error=error,
        log_path=str(log_path),
        **(metrics(w.kind, result, log_text) if status == "ok" else {}),
        dtype=str(engine["dtype"]),
        max_model_len=engine.get("max_model_len"),
        enforce_eager=bool(engine.get("enforce_eager")),
        seed=int(engine["seed"]),
        device=engine["device"],
        gpu_ids=",".join(gpu_ids) or None,
        device_name=_device_name(engine["device"]),
        vllm_version=_vllm_version(),
        torch_version=package_version("torch"),
        kb_nano_version=kb_nano.__version__,
        git_sha=git_sha(Path.cwd()),
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        wall_s=time.perf_counter() - t0,
    )
    return row, {"status": status, "error": error, "log": str(log_path), "vllm": result if status == "ok" else None}


_SERVER_DIED = "kb-nano: the vLLM server exited before it answered /health"


def _run_bench(model, tp, w: Workload, engine: dict, env: dict, bench_json: Path, log_path: Path) -> int | None:
    """Run the benchmark (and for serve the server) with output to ``log_path``; returns
    the exit status (negative = signal), or None on timeout. Every process group started
    here is SIGKILLed before returning, also when the job itself is interrupted."""
    deadline = time.monotonic() + float(engine["timeout_s"])
    groups: list[subprocess.Popen] = []

    def _kill_all():
        for p in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def _stop(signum, frame):  # Snakemake or the user interrupts the job
        _kill_all()
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with open(log_path, "w") as log_fh:
            if w.kind == "serve":
                port = free_port()
                server_cmd, cmd = serve_commands(model, tp, w, engine, port, bench_json)
                print("+ " + " ".join(server_cmd), file=log_fh, flush=True)
                server = subprocess.Popen(
                    server_cmd, stdout=log_fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
                groups.append(server)
                try:
                    died = wait_healthy(server, port, deadline)
                except TimeoutError:
                    return None
                if died is not None:
                    print(_SERVER_DIED, file=log_fh, flush=True)
                    return died
            else:
                cmd = bench_command(model, tp, w, engine, str(bench_json))
            print("+ " + " ".join(cmd), file=log_fh, flush=True)
            proc = subprocess.Popen(cmd, stdout=log_fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            groups.append(proc)
            try:
                return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return None
    finally:
        _kill_all()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _vllm_version() -> str | None:
    from kb_nano.e2e.vllm_cli import vllm_version

    return vllm_version()


def _device_name(device: str) -> str:
    """CPU model name from /proc/cpuinfo, or the first GPU's name from ``nvidia-smi``."""
    if device == "cpu":
        with contextlib.suppress(OSError):
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
        return "cpu"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.splitlines()[0].strip()
    return device
