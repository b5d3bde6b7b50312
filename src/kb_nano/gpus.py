"""GPU leasing: which concrete devices a job may use (torch-free).

Snakemake only counts GPUs (``resources: gpu=1`` with ``--resources gpu=N``); it does not
say *which* device a job gets. A job therefore leases concrete device ids from the
host's pool: one lock file per device under ``results/.locks/``, taken with ``flock``
(:mod:`filelock`) and held while the job runs; the lock belongs to the holding process,
so when that process is killed, even by SIGKILL, the kernel drops the lock and the
devices are free at once. The job exports the ids as ``CUDA_VISIBLE_DEVICES`` to the
process that uses them.

The pool, in order of precedence:

1. ``KB_NANO_GPU_IDS`` (comma-separated ids as ``CUDA_VISIBLE_DEVICES`` takes them):
   restrict the pool (``kb_nano kernels --gpu-pool N`` sets it to the first N ids), or
   give a CPU host a fake pool for tests. When ``CUDA_VISIBLE_DEVICES`` is also set, the
   ids must be among its ids.
2. ``CUDA_VISIBLE_DEVICES`` when set (SLURM sets it to the job's allocation): leases are
   taken among those ids only; empty or ``-1`` means no GPU.
3. Otherwise the GPUs ``nvidia-smi -L`` lists (ids ``0 .. count-1``); none without a driver.

Lock files are named per host (and per SLURM job when ``SLURM_JOB_ID`` is set, because
SLURM already gives each allocation its own devices and may renumber them from 0), so a
results directory on a shared file system does not couple different nodes.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from kb_nano.errors import KbNanoError

POOL_ENV = "KB_NANO_GPU_IDS"


class LeaseTimeout(KbNanoError):
    """No ``n`` devices of the pool became free within the timeout."""


def _parse_ids(value: str | None, name: str) -> list[str] | None:
    """Ids of a ``CUDA_VISIBLE_DEVICES``-style list; ``None`` when unset. CUDA stops at the
    first ``-1``; empty entries are dropped. Raises ``KbNanoError`` on a repeated id."""
    if value is None:
        return None
    ids: list[str] = []
    for item in (part.strip() for part in value.split(",")):
        if item == "-1":
            break
        if item:
            if item in ids:
                raise KbNanoError(f"{name}={value}: device id {item!r} is listed twice")
            ids.append(item)
    return ids


def _nvidia_smi_count() -> int:
    if not shutil.which("nvidia-smi"):
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out.returncode == 0 else 0


def pool(environ: Mapping[str, str] | None = None) -> list[str]:
    """The device ids this process may lease (strings as ``CUDA_VISIBLE_DEVICES`` takes
    them: ``"0"``, ``"3"``, ``"GPU-5fd1..."``), from ``KB_NANO_GPU_IDS``, else
    ``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi -L`` (see the module docstring).
    ``[]`` on a host without GPUs. Raises ``KbNanoError`` for a ``KB_NANO_GPU_IDS``
    that names ids outside ``CUDA_VISIBLE_DEVICES`` or repeats an id."""
    env = os.environ if environ is None else environ
    visible = _parse_ids(env.get("CUDA_VISIBLE_DEVICES"), "CUDA_VISIBLE_DEVICES")
    explicit = _parse_ids(env.get(POOL_ENV), POOL_ENV)
    if explicit is not None:
        outside = [i for i in explicit if visible is not None and i not in visible]
        if outside:
            raise KbNanoError(
                f"{POOL_ENV}={env[POOL_ENV]}: ids {','.join(outside)} are not in "
                f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}; pick among those"
            )
        return explicit
    if visible is not None:
        return visible
    return [str(i) for i in range(_nvidia_smi_count())]


def lock_path(lock_dir: Path, device_id: str, environ: Mapping[str, str] | None = None) -> Path:
    """Lock file of one device: ``{lock_dir}/gpu-{host}[-slurm{job}]-{id}.lock``."""
    env = os.environ if environ is None else environ
    scope = socket.gethostname() + (f"-slurm{env['SLURM_JOB_ID']}" if env.get("SLURM_JOB_ID") else "")
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{scope}-{device_id}")
    return Path(lock_dir) / f"gpu-{safe}.lock"


@contextlib.contextmanager
def lease(
    n: int,
    lock_dir: Path,
    timeout_s: float,
    ids: list[str] | None = None,
    poll_s: float = 0.1,
) -> Iterator[list[str]]:
    """Lease ``n`` devices of the pool for the duration of the ``with`` block.

    ``ids``: the pool (default :func:`pool`). Yields the leased ids in pool order (``[]``
    for ``n == 0``); the caller exports them to the process that uses them as
    ``CUDA_VISIBLE_DEVICES=",".join(ids)``. Takes free devices only (a non-blocking
    ``flock`` on each lock file); when fewer than ``n`` are free it releases what it took
    (so two jobs that each need two devices cannot deadlock holding one each) and tries
    again every ``poll_s`` seconds. The locks are released when the block
    exits or the process dies.

    Raises ``KbNanoError`` when the pool has fewer than ``n`` devices, and
    ``LeaseTimeout`` when ``n`` devices are not free within ``timeout_s`` seconds.
    A Tier-2 job that needs ``tp`` devices calls ``lease(tp, ...)``.
    """
    from filelock import FileLock, Timeout

    if n <= 0:
        yield []
        return
    ids = pool() if ids is None else list(ids)
    if len(ids) < n:
        where = f"ids {','.join(ids)}" if ids else "no GPU"
        raise KbNanoError(
            f"GPU lease: the job needs {n} device(s) but the pool has {len(ids)} ({where}); "
            f"set {POOL_ENV} or CUDA_VISIBLE_DEVICES, or run on a host with more GPUs"
        )
    lock_dir = Path(lock_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    locks = {i: FileLock(str(lock_path(lock_dir, i)), timeout=0) for i in ids}
    deadline = time.monotonic() + timeout_s
    held: list[str] = []
    try:
        while True:
            for i in ids:
                try:
                    locks[i].acquire(timeout=0)
                except Timeout:
                    continue
                held.append(i)
                if len(held) == n:
                    break
            if len(held) == n:
                break
            for i in held:
                locks[i].release()
            held = []
            if time.monotonic() >= deadline:
                raise LeaseTimeout(
                    f"GPU lease: {n} of the {len(ids)} device(s) {','.join(ids)} were not free within "
                    f"{timeout_s:g} s (other jobs hold their locks under {lock_dir}); lower --cores or "
                    f"--resources gpu=, or raise timeout_s"
                )
            time.sleep(poll_s)
        yield list(held)
    finally:
        for i in held:
            locks[i].release()
