"""One kernel job as Snakemake runs it: candidate × scenario -> one Parquet shard.

The measurement runs in a child process (:mod:`kb_nano.worker`) under a timeout. When
the child dies (signal, out of memory) or times out without writing its shard, this
process writes a ``crashed`` or ``timeout`` row instead, so every job ends with a row.
A GPU job first leases its device (:mod:`kb_nano.gpus`), holds the lease while the child
runs, and hands the id to the child as ``CUDA_VISIBLE_DEVICES``.
Torch-free: the parent stays light.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from kb_nano import worker
from kb_nano.candidates import file_sha256
from kb_nano.schema import make_row, scenario_fields, write_rows

# Workers are forked by a multiprocessing fork server that imported torch and the harness
# once (``set_forkserver_preload``), so a job pays a fork (12-19 ms), not a fresh
# interpreter importing torch (1.2-2.7 s on the 2-core dev machine; bench/overhead.py).
# Jobs run as threads of the Snakemake process (``run:`` + ``force-use-threads``), so one
# server serves the whole invocation; it exits with the Snakemake process.
_CONTEXT: multiprocessing.context.BaseContext | None = None
# Process.start() polls every other live child (multiprocessing.process._cleanup) and a
# fork-server child's exit code can be read only once: starting and reaping under one lock
# keeps two job threads from reading the same exit code.
_PROCESS_LOCK = threading.Lock()


def worker_context() -> multiprocessing.context.BaseContext:
    """The ``forkserver`` multiprocessing context whose server preloads
    :mod:`kb_nano.worker` and :mod:`kb_nano.bench` (and with it torch); created on first
    use, once per process."""
    global _CONTEXT
    with _PROCESS_LOCK:
        if _CONTEXT is None:
            ctx = multiprocessing.get_context("forkserver")
            # snakemake.cli: when Snakemake runs as the `snakemake` console script,
            # multiprocessing re-runs that script in every worker (its main-module fix-up;
            # Python 3.11 does not preload "__main__"), and the script imports
            # snakemake.cli: 0.6 s per worker unless the server has it imported already.
            ctx.set_forkserver_preload(["snakemake.cli", "kb_nano.worker", "kb_nano.bench"])
            _CONTEXT = ctx
        return _CONTEXT


def _kill_tree(pid: int) -> None:
    """SIGKILL a worker and every process it started (a candidate may spawn helpers)."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        parent = psutil.Process(pid)
        for proc in [*parent.children(recursive=True), parent]:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()


def run_job(input, output, params, wildcards, threads, resources, log) -> str:
    """The ``kernel_bench`` rule's ``run:`` block: Snakemake's job objects -> :func:`run`."""
    import json

    return run(
        scenario=json.loads(params.scenario),
        candidate_id=f"{wildcards.target}/{wildcards.name}",
        candidate_path=input.candidate,
        settings={**params.settings, "num_threads": threads, "golden": params.golden},
        output=output[0],
        log=log[0],
        root=os.getcwd(),
        gpus=int(resources.get("gpu", 0)),
    )


def gpus_to_lease(declared: int, device: str, pool_ids: list[str]) -> int:
    """Devices a kernel job leases: its declared Snakemake ``resources.gpu`` when the
    device setting is ``cuda``, or ``auto`` with a non-empty pool (``auto`` on a host
    without GPUs runs on the CPU and leases nothing). ``cuda:i`` pins device ``i`` as the
    user asked and leases nothing; ``cpu`` leases nothing."""
    if device == "cuda" or (device == "auto" and pool_ids):
        return int(declared)
    return 0


def run(
    scenario: dict,
    candidate_id: str,
    candidate_path: str,
    settings: dict,
    output: str,
    log: str,
    root: str,
    gpus: int = 0,
) -> str:
    """Lease the job's GPUs, run the worker, and make sure ``output`` holds a row afterwards.

    ``settings``: device, atol, num_warmup, num_runs, num_threads, timeout_s (seconds for
    the whole worker: import, setup, correctness and timing; also the longest wait for a
    free GPU). ``gpus``: the job's declared ``resources.gpu`` (see :func:`gpus_to_lease`).
    Worker stdout/stderr go to ``log``. The leased ids go to the worker as
    ``CUDA_VISIBLE_DEVICES`` and into the row's ``gpu_ids``; the row's ``started_at`` /
    ``ended_at`` are stamped inside the lease, before the worker starts and after it
    exited (see :mod:`kb_nano.schema`). Returns the row status.
    Raises ``KbNanoError`` (no row written, so the job is retried next run) when the pool
    is too small or no device becomes free within ``timeout_s``.
    """
    from kb_nano import gpus as leasing

    pool_ids = leasing.pool()
    n = gpus_to_lease(gpus, str(settings["device"]), pool_ids)
    with leasing.lease(n, Path(root) / "results/.locks", float(settings["timeout_s"]), ids=pool_ids) as ids:
        return _run_leased(scenario, candidate_id, candidate_path, settings, output, log, root, ids)


def _run_leased(scenario, candidate_id, candidate_path, settings, output, log, root, gpu_ids: list[str]) -> str:
    # absolute, so a candidate that changes the working directory cannot misplace the shard
    out = Path(output) if Path(output).is_absolute() else Path(root) / output
    log = str(Path(log) if Path(log).is_absolute() else Path(root) / log)
    out.unlink(missing_ok=True)
    spec = {
        "gpu_ids": ",".join(gpu_ids) or None,
        "owner_pid": os.getpid(),
        "scenario": scenario,
        "candidate_id": candidate_id,
        "candidate_path": candidate_path,
        "settings": settings,
        "output": str(out),
        "root": root,
    }
    t0 = time.perf_counter()
    started_at = _utc_now()
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    status = error = None
    ctx = worker_context()
    proc = ctx.Process(target=worker.run, args=(spec, str(log)), name=f"kb_nano {candidate_id} {scenario['scenario_id']}")
    with _PROCESS_LOCK:  # Process.start() polls the other live workers (see _PROCESS_LOCK)
        proc.start()
    try:
        finished = multiprocessing.connection.wait([proc.sentinel], timeout=float(settings["timeout_s"]))
    except BaseException:  # interrupted while waiting: take the worker down with us
        _kill_tree(proc.pid)
        raise
    if not finished:
        _kill_tree(proc.pid)
        status, error = "timeout", f"exceeded timeout_s={settings['timeout_s']}; worker killed (log: {log})"
    with _PROCESS_LOCK:
        proc.join()
        code = proc.exitcode
    if status is None and code == -signal.SIGINT:
        # Ctrl-C reached the worker (it shares the terminal's process group): no row, so
        # Snakemake leaves the job incomplete and the next run does it again. (A SIGINT a
        # candidate sends itself does not end up here: kb_nano.worker turns it into a
        # failed exit, hence a crashed row.)
        raise KeyboardInterrupt(f"{candidate_id} on {scenario['scenario_id']}: interrupted")
    ended_at = _utc_now()
    if status is None and not out.exists():
        status, error = "crashed", _crash_reason(code, log)
    if status is not None:
        write_rows(
            [
                make_row(
                    **{**scenario_fields(scenario), "input_source": "golden" if settings.get("golden") else "random"},
                    candidate=candidate_id,
                    candidate_sha256=file_sha256(candidate_path),
                    gpu_ids=spec["gpu_ids"],
                    status=status,
                    error=error,
                    atol=_tolerance(settings, scenario, "atol"),
                    rtol=_tolerance(settings, scenario, "rtol"),
                    num_warmup=int(settings["num_warmup"]),
                    num_runs=int(settings["num_runs"]),
                    created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    started_at=started_at,
                    ended_at=ended_at,
                    wall_s=time.perf_counter() - t0,
                )
            ],
            out,
        )
        return status
    return _stamp(out, started_at, ended_at)


def _utc_now() -> str:
    """Now as ISO 8601 UTC with microseconds (``2026-11-20T10:31:07.123456+00:00``)."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def _stamp(shard: Path, started_at: str, ended_at: str) -> str:
    """Set ``started_at`` / ``ended_at`` of the worker's shard (rewritten atomically, while
    the job still holds its lease); returns the row status."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kb_nano.schema import write_table

    table = pq.read_table(shard)
    for name, value in (("started_at", started_at), ("ended_at", ended_at)):
        column = pa.array([value] * table.num_rows, pa.string())
        table = table.set_column(table.schema.get_field_index(name), name, column)
    write_table(table, shard)
    return table.column("status")[0].as_py()


def _tolerance(settings: dict, scenario: dict, key: str) -> float | None:
    """The config's global atol/rtol, else the operator's from the manifest (as bench does)."""
    value = settings.get(key) if settings.get(key) is not None else scenario.get(key)
    return None if value is None else float(value)


def _crash_reason(code: int | None, log: str) -> str:
    how = f"killed by signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited with status {code}"
    last = ""
    try:
        lines = [ln.strip() for ln in Path(log).read_text(errors="replace").splitlines() if ln.strip()]
        last = lines[-1][:200] if lines else ""
    except OSError:
        pass
    return f"worker {how} without a result" + (f": {last}" if last else "") + f" (log: {log})"
