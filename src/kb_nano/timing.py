"""Timing of a baseline/candidate pair on CPU or CUDA.

Calls alternate baseline, candidate, baseline, ... so drift (clock boost, other jobs)
hits both sides alike. CPU: ``time.perf_counter_ns`` around each call. CUDA: a CUDA
event pair around each call, the L2 cache flushed before each call by zeroing a buffer
larger than L2 (as Triton's ``do_bench`` does), one device synchronisation at the end.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

L2_FLUSH_BYTES = 256 * 1024 * 1024  # > L2 of every current NVIDIA GPU (H100/H200: 50 MB)


@contextlib.contextmanager
def exclusive(device: torch.device, lock_dir: Path):
    """Hold a host-wide lock for ``device`` while timing, so that concurrent Snakemake jobs
    (``--cores all``) build modules and check correctness in parallel but never time at
    the same moment on the same CPU or GPU. One lock file per device under ``lock_dir``;
    the OS releases it when the process dies (``filelock``, ``fcntl`` based)."""
    from filelock import FileLock

    if device.type == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "all").replace(",", "_")
        name = f"cuda-{visible}-{device.index or 0}"
    else:
        name = device.type
    lock_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock_dir / f"{name}.lock")):
        yield


def time_pair(
    baseline: Callable[[], object],
    candidate: Callable[[], object],
    device: torch.device,
    num_warmup: int,
    num_runs: int,
) -> tuple[list[float], list[float]]:
    """Time ``num_runs`` alternating calls of each zero-argument callable after
    ``num_warmup`` untimed calls of each. Returns per-call times in milliseconds
    ``(baseline_ms, candidate_ms)``."""
    for _ in range(num_warmup):
        baseline()
        candidate()
    if device.type == "cuda":
        return _time_cuda(baseline, candidate, device, num_runs)
    return _time_cpu(baseline, candidate, num_runs)


def _time_cpu(baseline, candidate, num_runs):
    times = ([], [])
    for _ in range(num_runs):
        for fn, out in zip((baseline, candidate), times):
            t0 = time.perf_counter_ns()
            fn()
            out.append((time.perf_counter_ns() - t0) / 1e6)
    return times


def _time_cuda(baseline, candidate, device, num_runs):
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)
    events = ([], [])
    torch.cuda.synchronize(device)
    for _ in range(num_runs):
        for fn, ev in zip((baseline, candidate), events):
            flush.zero_()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            ev.append((start, end))
    torch.cuda.synchronize(device)
    return tuple([s.elapsed_time(e) for s, e in ev] for ev in events)


def summarize(times_ms: list[float]) -> tuple[float, float]:
    """Median and interquartile range (p75 - p25) of per-call times, in ms."""
    a = np.asarray(times_ms, dtype=np.float64)
    q25, q50, q75 = np.percentile(a, [25, 50, 75])
    return float(q50), float(q75 - q25)
