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
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from kb_nano.candidates import file_sha256
from kb_nano.schema import make_row, scenario_fields, write_rows


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
    ``CUDA_VISIBLE_DEVICES`` and into the row's ``gpu_ids``. Returns the row status.
    Raises ``KbNanoError`` (no row written, so the job is retried next run) when the pool
    is too small or no device becomes free within ``timeout_s``.
    """
    from kb_nano import gpus as leasing

    pool_ids = leasing.pool()
    n = gpus_to_lease(gpus, str(settings["device"]), pool_ids)
    with leasing.lease(n, Path(root) / "results/.locks", float(settings["timeout_s"]), ids=pool_ids) as ids:
        return _run_leased(scenario, candidate_id, candidate_path, settings, output, log, root, ids)


def _run_leased(scenario, candidate_id, candidate_path, settings, output, log, root, gpu_ids: list[str]) -> str:
    from kb_nano.gpus import environ

    out = Path(output)
    out.unlink(missing_ok=True)
    spec = {
        "gpu_ids": ",".join(gpu_ids) or None,
        "scenario": scenario,
        "candidate_id": candidate_id,
        "candidate_path": candidate_path,
        "settings": settings,
        "output": str(out),
        "root": root,
    }
    t0 = time.perf_counter()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(spec, fh)
        spec_path = fh.name
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    status = error = None
    try:
        with open(log, "w") as log_fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kb_nano.worker", spec_path],
                stdout=log_fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=environ(gpu_ids),
            )

            def _stop(signum, frame):  # Snakemake or the user interrupts the job
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                raise SystemExit(128 + signum)

            previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
            try:
                code = proc.wait(timeout=float(settings["timeout_s"]))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                status, error = "timeout", f"exceeded timeout_s={settings['timeout_s']}; worker killed (log: {log})"
            else:
                if not out.exists():
                    status, error = "crashed", _crash_reason(code, log)
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
    finally:
        os.unlink(spec_path)
    if status is not None:
        write_rows(
            [
                make_row(
                    **scenario_fields(scenario),
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
                    wall_s=time.perf_counter() - t0,
                )
            ],
            out,
        )
        return status
    import pyarrow.parquet as pq

    return pq.read_table(out, columns=["status"]).column(0)[0].as_py()


def _tolerance(settings: dict, scenario: dict, key: str) -> float | None:
    """The config's global atol/rtol, else the operator's from the manifest (as bench does)."""
    value = settings.get(key) if settings.get(key) is not None else scenario.get(key)
    return None if value is None else float(value)


def _crash_reason(code: int, log: str) -> str:
    how = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
    last = ""
    try:
        lines = [ln.strip() for ln in Path(log).read_text(errors="replace").splitlines() if ln.strip()]
        last = lines[-1][:200] if lines else ""
    except OSError:
        pass
    return f"worker {how} without a result" + (f": {last}" if last else "") + f" (log: {log})"
