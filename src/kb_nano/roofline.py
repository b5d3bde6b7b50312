"""Roofline bound of one call, from the device's measured copy bandwidth and matmul rate,
to flag implausible speedups for review.

A call that moves ``bytes_moved`` bytes and does ``flops`` floating-point operations
(the operator's minimum traffic, recorded in the manifest) cannot take less than
``max(bytes_moved / copy_bandwidth, flops / matmul_rate)`` (Williams, Waterman &
Patterson, "Roofline", CACM 52(4), 2009), where both peaks are measured on this device:
a device-to-device copy (bytes read + written per second) and a square matmul in the
scenario dtype. A candidate faster than :data:`MARGIN` times that bound is flagged in the
row's ``review`` column: the status stays as measured, a person looks. The peaks are
measured once per host, device, torch version and dtype and cached under
``results/.device/`` (the config's ``roofline`` block overrides them); on a CPU, whose
caches are not flushed between timed calls, the copy bandwidth is measured at the call's
own working-set size instead.
"""

from __future__ import annotations

import functools
import json
import math
import socket
from pathlib import Path

import torch

from kb_nano.kernels import timing

MARGIN = 0.8  # flag below 80% of the bound: measured peaks are ~90-95% of datasheet peaks
COPY_BYTES = {"cuda": 1 << 30, "cpu": 1 << 28}  # copy size: far above L2 (H200: 60 MB) / a CPU's LLC
MATMUL_N = {"cuda": 8192, "cpu": 1024}
PEAKS_METHOD = 2  # cached peaks of another method (``a @ b`` only) are measured again


def _time_best_ms(fn, device: torch.device, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = timing._Event(enable_timing=True), timing._Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            timing._synchronize(device)
            best = min(best, start.elapsed_time(end))
        else:
            t0 = timing._perf_counter_ns()
            fn()
            best = min(best, (timing._perf_counter_ns() - t0) / 1e6)
    return best


def measure_peaks(device: torch.device, dtype: torch.dtype) -> dict:
    """Measured peaks of ``device``: ``copy_gbps`` (GB/s, 1e9 bytes, read + write of a
    ``COPY_BYTES`` copy, best of 5) and ``matmul_tflops`` (1e12 flop/s, ``2 n^3`` of an
    ``n x n`` matmul in ``dtype``, best of 5 of ``a @ b`` and of ``F.linear``), and the
    ``method`` that measured them (:data:`PEAKS_METHOD`)."""
    kind = device.type
    src = torch.empty(COPY_BYTES[kind] // 2, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    copy_ms = _time_best_ms(functools.partial(dst.copy_, src), device, 5)
    del src, dst
    n = MATMUL_N[kind]
    mm_dtype = dtype if dtype.is_floating_point else torch.float32
    a = torch.randn(n, n, device=device).to(mm_dtype)
    b = torch.randn(n, n, device=device).to(mm_dtype)
    # the faster of the two GEMM entry points: on a CPU a bf16 ``a @ b`` takes a slow path
    # (0.97 GFLOP/s on the 2-core EPYC, one thread, torch 2.13) where ``F.linear``, which
    # the baselines call, takes oneDNN's (10.3 GFLOP/s), and the bound must hold for both
    mm_ms = min(
        _time_best_ms(lambda: a @ b, device, 5),
        _time_best_ms(lambda: torch.nn.functional.linear(a, b), device, 5),
    )
    return {
        "copy_gbps": COPY_BYTES[kind] / copy_ms / 1e6,
        "matmul_tflops": 2 * n**3 / mm_ms / 1e9,
        "method": PEAKS_METHOD,
    }


def copy_gbps_at(device: torch.device, nbytes: int) -> float:
    """Copy bandwidth (GB/s, read + write) of a copy moving ``nbytes`` in all, best of 20,
    the source written just before each copy: on a CPU, where no cache is flushed
    between timed calls, a working set that fits in cache is copied at cache speed, and
    the bound must use that speed (a DRAM figure would flag honest small kernels)."""
    src = torch.ones(max(nbytes // 2, 4096), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def once():
        src.add_(1)
        t0 = timing._perf_counter_ns()
        dst.copy_(src)
        return timing._perf_counter_ns() - t0

    best = min(once() for _ in range(20))
    return 2 * src.numel() / max(best, 1)  # bytes per ns = GB/s


def peaks(
    device: torch.device,
    device_name: str,
    dtype: torch.dtype,
    cache_dir: Path,
    overrides: dict | None = None,
    working_set: int | None = None,
) -> dict:
    """The device's peaks (see :func:`measure_peaks`), read from
    ``cache_dir/{host}-{device}-{dtype}.json`` or measured and written there; on a CPU with
    ``working_set`` (the call's bytes moved) the copy bandwidth is measured at that size
    (:func:`copy_gbps_at`), the cached figure where that is higher. Keys in ``overrides`` (the config's ``roofline``
    block, non-null values) replace measured ones. Call it while holding the device's
    timing lock."""
    from kb_nano.files import atomic_path

    safe = "".join(
        c if c.isalnum() else "_" for c in f"{socket.gethostname()}-{device_name}-{torch.__version__}-{dtype}"
    )
    path = cache_dir / f"{safe}.json"
    try:
        value = json.loads(path.read_text())
        if (
            not all(
                isinstance(value.get(k), (int, float)) and math.isfinite(value[k]) and value[k] > 0
                for k in ("copy_gbps", "matmul_tflops")
            )
            or value.get("method") != PEAKS_METHOD
        ):
            raise ValueError(f"{path}: not a peaks record of this method")  # damaged, edited or old: measure again
    except (OSError, ValueError, AttributeError):
        value = measure_peaks(device, dtype)
        cache_dir.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            Path(tmp).write_text(json.dumps(value))
    if device.type == "cpu" and working_set:
        # never below the cached (DRAM-sized) figure: a copy of any size runs at least that
        # fast, and on a loaded host all 20 tries of one job were preempted (0.53 GB/s where
        # sibling jobs measured 43-168), which flagged an honest row as implausible
        value["copy_gbps"] = max(value["copy_gbps"], copy_gbps_at(device, int(working_set)))
    value.update({k: float(v) for k, v in (overrides or {}).items() if v is not None})
    return value


def bound_ms(bytes_moved: int | None, flops: int | None, peak: dict) -> float | None:
    """Lower bound in ms of one call: ``max(bytes / copy_gbps, flops / matmul_tflops)``;
    None when neither traffic figure is known."""
    terms = []
    if bytes_moved:
        terms.append(bytes_moved / (peak["copy_gbps"] * 1e6))
    if flops:
        terms.append(flops / (peak["matmul_tflops"] * 1e9))
    return max(terms) if terms else None


def review(candidate_ms: float, bound: float | None, peak: dict) -> str | None:
    """The review message when ``candidate_ms`` is below ``MARGIN`` x ``bound``, else None."""
    if bound is None or candidate_ms >= MARGIN * bound:
        return None
    return (
        f"implausible: candidate {candidate_ms:.4g} ms is below the roofline bound {bound:.4g} ms "
        f"(copy {peak['copy_gbps']:.3g} GB/s, matmul {peak['matmul_tflops']:.3g} TFLOP/s, measured unless the "
        "config's roofline block sets them); check the result by hand"
    )
