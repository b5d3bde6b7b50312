"""Clocks of a worker process, and the statistics the judge computes from them.

Method:

- Paired A/B (:mod:`kb_nano.kernels.judge`): the judge alternates a batch of calls of the
  baseline worker and a batch of the candidate worker (ABAB), call ``i`` of both batches
  on the same input values, so drift (clock boost, thermal state, other jobs) hits both
  sides alike; the pairs feed a paired bootstrap interval (:func:`speedup_ci`).
- Fresh inputs: each call of a batch has its own input slot, and the judge writes
  never-seen values into every slot before every batch (untimed).
- CPU (:func:`time_calls`): ``time.perf_counter_ns`` around each call.
- CUDA (:func:`time_calls`): a CUDA event pair around each call on the current stream;
  before each call the L2 cache is flushed by zeroing a buffer of twice the device's L2
  size, at least ``triton.testing.do_bench``'s 256 MiB (:func:`l2_flush_bytes`); one
  device-wide synchronize at the end of the batch. :func:`time_calls_wall` times each
  call from the host with a device-wide ``torch.cuda.synchronize()`` after it, which
  also waits for work the call left on other streams: :func:`hidden_work_ms` compares
  the two.
- CUDA graphs (:func:`time_graph`): the calls of one batch (one per input slot) captured
  in one graph and replayed; per-call time is the replay time divided by the calls.
- Statistics: median and interquartile range per side; the speedup is the ratio of
  medians with a paired bootstrap 95% confidence interval (:func:`speedup_ci`).

The clock and statistics functions are bound when this module is imported, which a
worker does before it imports any candidate, so a candidate that later replaces
``time.perf_counter_ns``, ``torch.cuda.Event`` or numpy's statistics does not change what
the worker calls (and :mod:`kb_nano.kernels.guard` reports the replacement as
``tampered``). A candidate can still forge what its own worker reports; the judge checks
the reported times against its own clock around each batch
(:func:`kb_nano.kernels.judge.hidden_ms`).
"""

from __future__ import annotations

from time import perf_counter_ns as _perf_counter_ns
from time import sleep as _sleep
from typing import Callable

import numpy as np
import torch

# Bound at import, before any candidate is imported (see the module docstring).
_Event = torch.cuda.Event
_synchronize = torch.cuda.synchronize
_CUDAGraph = torch.cuda.CUDAGraph
_graph = torch.cuda.graph
_percentile = np.percentile
_median = np.median
_default_rng = np.random.default_rng

WALL_CHECK_RUNS = 20  # calls per side of the device-wide (host clock + synchronize) pass
BOOTSTRAP_RESAMPLES = 2000
DO_BENCH_FLUSH_BYTES = 256 * 1024 * 1024  # triton.testing.do_bench's cache-clearing buffer (256 MiB)


def l2_flush_bytes(device: torch.device) -> int:
    """Bytes zeroed before each timed CUDA call: twice the device's L2 cache
    (``L2_cache_size`` of ``torch.cuda.get_device_properties``; H200: 60 MiB), and at least
    the 256 MiB Triton's ``do_bench`` zeroes. The floor matters for small kernels: zeroing
    keeps the GPU busy while the host launches the timed call (~65 us for 256 MiB on an
    H200), so, as in ``do_bench``, host launch latency up to that long is not counted; with
    only 2 x L2 (120 MiB) kb-nano measured launch-bound kernels up to 3.7x slower than
    ``do_bench`` (bench/FIDELITY.md). 0 on a CPU (no flush there)."""
    if device.type != "cuda":
        return 0
    l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
    return max(2 * l2, DO_BENCH_FLUSH_BYTES)


def time_calls(call: Callable[[int], object], slots: range, device: torch.device,
               flush: torch.Tensor | None, after: Callable[[int, object], None]) -> list[float]:
    """Time one call per input slot in ``slots``; returns ms per call.

    ``call(i)`` runs the module on slot ``i``; ``after(i, out)`` (untimed) keeps the
    output (copies it to the judge's output slot). CPU: host clock around the call.
    CUDA: ``flush`` zeroed before each call, an event pair around it, ``after`` queued on
    the stream after the end event, one synchronize at the end."""
    if device.type != "cuda":
        times = []
        for i in slots:
            t0 = _perf_counter_ns()
            out = call(i)
            times.append((_perf_counter_ns() - t0) / 1e6)
            after(i, out)
        return times
    events = []
    for i in slots:
        if flush is not None:
            flush.zero_()
        start, end = _Event(enable_timing=True), _Event(enable_timing=True)
        start.record()
        out = call(i)
        end.record()
        after(i, out)
        events.append((start, end))
    _synchronize(device)
    return [s.elapsed_time(e) for s, e in events]


def time_calls_wall(call: Callable[[int], object], slots: range, device: torch.device,
                    flush: torch.Tensor | None, after: Callable[[int, object], None]) -> tuple[list[float], list[float]]:
    """CUDA device-wide pass: per call, the host clock from before the launch to after a
    device-wide synchronize, and the event time of the same call, in ms:
    ``(wall_ms, event_ms)``."""
    walls, evs = [], []
    for i in slots:
        if flush is not None:
            flush.zero_()
        _synchronize(device)
        start, end = _Event(enable_timing=True), _Event(enable_timing=True)
        t0 = _perf_counter_ns()
        start.record()
        out = call(i)
        end.record()
        _synchronize(device)
        walls.append((_perf_counter_ns() - t0) / 1e6)
        evs.append(start.elapsed_time(end))
        after(i, out)
    _synchronize(device)
    return walls, evs


def capture_graph(call: Callable[[int], object], slots: range, device: torch.device):
    """Capture one call per slot in ``slots`` into one CUDA graph (after three warm-up
    rounds on a side stream, as ``torch.cuda.graphs`` documents). Returns
    ``(graph, outputs)``: replaying the graph rewrites ``outputs`` (one per slot).
    Raises whatever capture raises (a call that synchronizes, an unjoined stream)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            for i in slots:
                call(i)
    torch.cuda.current_stream(device).wait_stream(side)
    _synchronize(device)
    g = _CUDAGraph()
    with _graph(g):
        outs = [call(i) for i in slots]
    return g, outs


def time_graph(graph, device: torch.device, flush: torch.Tensor | None) -> float:
    """One replay of ``graph`` in ms (event pair; L2 flushed first; synchronized)."""
    if flush is not None:
        flush.zero_()
    start, end = _Event(enable_timing=True), _Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    _synchronize(device)
    return start.elapsed_time(end)


def hidden_work_ms(base_wall, base_event, cand_wall, cand_event) -> float | None:
    """Per-call device time the candidate's events missed, in ms: the median of
    (device-wide wall - event) per candidate call, minus the same for the baseline (which
    calibrates the host's launch and synchronize latency). A call that leaves work on
    another stream returns before that work ends, so its event pair misses it while the
    device-wide synchronize waits for it. None without samples (CPU)."""
    if not cand_wall or not base_wall:
        return None
    gap_c = float(_median(np.subtract(cand_wall, cand_event)))
    gap_b = float(_median(np.subtract(base_wall, base_event)))
    return gap_c - gap_b


def hidden_work_limit_ms(candidate_ms: float) -> float:
    """The most unaccounted per-call time tolerated before a row is ``unsynced_work``:
    half the candidate's median, at least 0.01 ms (10 us absorbs host-side jitter of
    launch and synchronize; measured on the H200, see bench/FIDELITY.md)."""
    return max(0.5 * candidate_ms, 0.01)


def summarize(times_ms: list[float]) -> tuple[float, float]:
    """Median and interquartile range (p75 - p25) of per-call times, in ms."""
    a = np.asarray(times_ms, dtype=np.float64)
    q25, q50, q75 = _percentile(a, [25, 50, 75])
    return float(q50), float(q75 - q25)


def speedup_ci(
    baseline_ms: list[float], candidate_ms: list[float], seed: int, level: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES
) -> tuple[float, float]:
    """Paired percentile-bootstrap confidence interval of ``median(baseline) /
    median(candidate)``.

    Call ``i`` of each side ran on the same values in adjacent batches (ABAB), so pairs
    are resampled together: ``resamples`` draws of ``n`` pair indices with replacement,
    the ratio of medians of each draw, and the ``(1 - level) / 2`` and ``(1 + level) / 2``
    quantiles of those ratios (Efron & Tibshirani, *An Introduction to the Bootstrap*,
    1993, ch. 13). Deterministic for a given ``seed``. Raises ``ValueError`` when the
    lists differ in length or are empty."""
    b = np.asarray(baseline_ms, dtype=np.float64)
    c = np.asarray(candidate_ms, dtype=np.float64)
    if len(b) != len(c) or len(b) == 0:
        raise ValueError(f"paired samples needed, got {len(b)} baseline and {len(c)} candidate times")
    idx = _default_rng(seed).integers(0, len(b), size=(resamples, len(b)))
    ratios = _median(b[idx], axis=1) / np.maximum(_median(c[idx], axis=1), 1e-12)
    lo, hi = _percentile(ratios, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def wait_briefly(seconds: float) -> None:
    """Sleep ``seconds`` with the sleep bound at import (used by the output-stability
    check of :mod:`kb_nano.kernels.checks`)."""
    _sleep(seconds)


def now_ns() -> int:
    """The host clock bound at import (``time.perf_counter_ns``), in ns."""
    return _perf_counter_ns()
