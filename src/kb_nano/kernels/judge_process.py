"""The judge process of one device: serves the kernel jobs of a Snakemake invocation one
scenario at a time and writes their shards.

:mod:`kb_nano.kernels.job` starts one per device (``cpu``, or each leased GPU) from a
fork server (torch-free: each judge starts its workers' fork server first, then imports
torch while that server does), and sends it one request per job; the judge keeps its
workers (:class:`kb_nano.kernels.pool.Pool`) between requests and dies with the
Snakemake process.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
import types
from datetime import UTC, datetime
from pathlib import Path

from kb_nano.kernels.pool import Pool, prewarm  # torch-free: the judge imports torch after prewarm()
from kb_nano.kernels.procs import end_servers, quiet_when_owner_gone

_STARTED: list[float] = []  # epoch seconds: the judge's start and the end of its imports (first job's log)


def utc_now() -> str:
    """Now as ISO 8601 UTC with microseconds (``2026-11-20T10:31:07.123456+00:00``)."""
    return datetime.now(UTC).isoformat(timespec="microseconds")


def serve(conn, spec: dict) -> None:
    """Entry point (a ``multiprocessing`` target); :func:`_serve` with a Snakemake process
    that is gone ending the judge quietly (:func:`kb_nano.kernels.procs.quiet_when_owner_gone`)."""
    with quiet_when_owner_gone():
        _serve(conn, spec)


def _serve(conn, spec: dict) -> None:
    """The judge's life. ``spec``: ``env`` (set first:
    ``CUDA_VISIBLE_DEVICES`` of the leased GPU), ``owner_pid`` (the Snakemake process),
    ``gpu_ids``, ``bind_later`` (a prestarted judge: its first request is ``{"bind":
    {"env", "gpu_ids"}}``, answered ``{"bound": True}``; nothing has touched CUDA yet). Each request is a dict with ``scenario``, ``candidate_id``,
    ``candidate_path``, ``settings``, ``output``, ``log``, ``root``; the reply is
    ``{"status"}`` after the shard is written, ``{"interrupted"}`` (no shard), or
    ``{"error"}`` (a failure of the baseline or the judge; no shard)."""
    os.environ.update(spec.get("env") or {})
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _STARTED.append(time.time())
    # multiprocessing makes every child import its parent's __main__ (here Snakemake's
    # script, 1-2 s): the judge's workers need nothing of it
    sys.modules["__main__"] = types.ModuleType("__main__")
    prewarm()  # the workers' fork server imports torch while the judge does (below)
    from kb_nano.kernels.measure import Interrupted
    from kb_nano.kernels.worker_process import _die_with_owner

    _die_with_owner(int(spec["owner_pid"]))
    _STARTED.append(time.time())  # imports done
    pools: dict[tuple, Pool] = {}
    gpu_ids = spec.get("gpu_ids")
    warm: list = []  # candidate files whose workers the first CUDA pool starts at once (job.warm_candidates)
    try:
        while True:
            try:
                req = conn.recv()
            except EOFError:
                break
            if req is None:
                break
            if "bind" in req:  # a prestarted judge gets its device before its first request
                if pools or not spec.get("bind_later"):
                    conn.send({"error": "a judge is bound once, before its first request"})
                    continue
                os.environ.update(req["bind"]["env"])
                gpu_ids = req["bind"]["gpu_ids"]
                warm = req["bind"].get("warm") or []
                conn.send({"bound": True})
                continue
            try:
                conn.send({"status": _one(req, pools, gpu_ids, warm)})
                warm = []
            except Interrupted as exc:
                conn.send({"interrupted": str(exc)})
            except Exception as exc:
                from kb_nano.candidates import one_line

                conn.send({"error": one_line(exc), "traceback": traceback.format_exc()})
    finally:
        for pool in pools.values():
            pool.close()
        end_servers()


def _log_timeline(fd: int, asked_at: float | None) -> None:
    """On the judge's first job: when the judge started and finished its imports, and
    when the job asked for it, relative to now (the job log; where a slow start went)."""
    if len(_STARTED) == 2 and asked_at:
        now = time.time()
        os.write(
            fd,
            (
                f"kb_nano: judge started {now - _STARTED[0]:.2f} s ago, imports done {now - _STARTED[1]:.2f} s "
                f"ago; this job asked for it {now - asked_at:.2f} s ago\n"
            ).encode(),
        )
        _STARTED.append(now)


def _one(req: dict, pools: dict, gpu_ids: str | None, warm: list) -> str:
    """Measure one request and write its signed shard; returns the status."""
    from kb_nano.kernels import signing
    from kb_nano.kernels.fields import resolve_device
    from kb_nano.kernels.measure import measure
    from kb_nano.kernels.schema import write_rows

    root = Path(req["root"])
    settings = req["settings"]
    device = str(resolve_device(settings["device"]))
    key = (device, str(root))
    if key not in pools:
        env = {"OMP_WAIT_POLICY": "PASSIVE"}
        if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
            env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
        pools[key] = Pool(device, env, root)
    out = Path(req["output"])
    out.unlink(missing_ok=True)
    Path(req["log"]).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    try:
        _log_timeline(fd, req.get("asked_at"))
        if warm and device.startswith("cuda"):
            # CUPTI's start is serialised between the processes of a GPU (seconds each): this
            # job's two workers first, then the other candidates' in the order of their jobs
            deadline = time.monotonic() + float(settings["timeout_s"])
            pools[key].start_baseline(settings, fd, deadline)
            mine = str(Path(req["candidate_path"]).resolve())
            n = pools[key].warm(sorted(warm, key=lambda f: f[0] != mine), settings, fd, deadline)
            os.write(fd, f"kb_nano: started the workers of {n} candidate(s) ahead of their jobs\n".encode())
        started_at, load_start = utc_now(), os.getloadavg()[0]
        row = measure(req["scenario"], req["candidate_id"], Path(req["candidate_path"]), settings, root, pools[key], fd)
        row.update(gpu_ids=gpu_ids, started_at=started_at, ended_at=utc_now())
        # how busy the host was: a load above the CPUs available makes the times and intervals unreliable
        row.update(
            load_avg_start=load_start, load_avg_end=os.getloadavg()[0], cpus_available=len(os.sched_getaffinity(0))
        )
        write_rows([row], out, secret=signing.key(root))
        line = f"{row['scenario_id']} {row['candidate']}: {row['status']}" + (
            f" ({row['error']})" if row["error"] else ""
        )
        os.write(fd, (line + "\n").encode())
        return row["status"]
    except Exception:
        os.write(fd, traceback.format_exc().encode())
        raise
    finally:
        os.close(fd)
