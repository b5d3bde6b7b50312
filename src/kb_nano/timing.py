"""Timing of a baseline/candidate pair on CPU or CUDA, and its statistics.

Method (issue 7; the CUDA part follows Triton's ``triton.testing.do_bench``):

- Paired A/B: calls alternate baseline, candidate, baseline, ... (ABAB), on the same
  input values, so drift (clock boost, thermal state, other jobs) hits both sides alike.
- Fresh inputs: before every call ``refresh(i)`` writes never-seen values into the input
  buffers of iteration ``i`` (two buffer sets rotate), so a cache keyed on input
  identity, pointer or content never hits. Not timed.
- CPU: ``time.perf_counter_ns`` around each call.
- CUDA: a CUDA event pair around each call on the current stream; before each call the
  L2 cache is flushed by zeroing a buffer of twice the device's L2 size
  (``torch.cuda.get_device_properties().L2_cache_size``), at least do_bench's 256 MiB
  (:func:`l2_flush_bytes`); one device-wide synchronize at the end. A second, shorter
  pass times each call from the host with a device-wide ``torch.cuda.synchronize()``
  after it, which also waits for work the call left on
  other streams: :func:`hidden_work_ms` compares the two.
- Optional CUDA-graph replay (:func:`time_graphs`): each side captured once and replayed,
  reported in separate columns.
- Statistics: median and interquartile range per side; the speedup is the ratio of
  medians with a paired bootstrap 95% confidence interval (:func:`speedup_ci`).

The clock and statistics functions are bound when this module is imported, which the
harness does before it imports any candidate, so a candidate that later replaces
``time.perf_counter_ns``, ``torch.cuda.Event``, ``torch.cuda.synchronize`` or numpy's
statistics does not change what the harness calls (and :mod:`kb_nano.checks` reports the
replacement as ``tampered``).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
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


@dataclass
class Timings:
    """Per-call times in ms of one paired measurement.

    ``baseline_ms``/``candidate_ms``: the main pass (events on CUDA, host clock on CPU),
    ``num_runs`` each. ``baseline_wall_ms``/``candidate_wall_ms`` and
    ``baseline_event_ms``/``candidate_event_ms``: the device-wide pass on CUDA (host clock
    around call + ``torch.cuda.synchronize()``, and the events of the same calls);
    empty on CPU. ``l2_flush_bytes``: bytes zeroed before each CUDA call (0 on CPU).
    """

    baseline_ms: list[float]
    candidate_ms: list[float]
    baseline_wall_ms: list[float] = field(default_factory=list)
    candidate_wall_ms: list[float] = field(default_factory=list)
    baseline_event_ms: list[float] = field(default_factory=list)
    candidate_event_ms: list[float] = field(default_factory=list)
    l2_flush_bytes: int = 0


def time_pair(
    baseline: Callable[[int], object],
    candidate: Callable[[int], object],
    refresh: Callable[[int], None],
    device: torch.device,
    num_warmup: int,
    num_runs: int,
) -> Timings:
    """Time ``num_runs`` alternating calls of each side after ``num_warmup`` untimed calls
    of each. ``baseline(i)`` / ``candidate(i)`` run one call on the input buffers of
    iteration ``i``; ``refresh(i)`` (untimed) writes fresh values into them first.
    Returns :class:`Timings` (ms)."""
    calls = 0
    for _ in range(num_warmup):
        refresh(calls)
        baseline(calls)
        candidate(calls)
        calls += 1
    if device.type != "cuda":
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(num_runs):
            refresh(calls)
            for fn, out in zip((baseline, candidate), times):
                t0 = _perf_counter_ns()
                fn(calls)
                out.append((_perf_counter_ns() - t0) / 1e6)
            calls += 1
        return Timings(*times)
    nbytes = l2_flush_bytes(device)
    flush = torch.empty(nbytes, dtype=torch.int8, device=device)
    events: tuple[list, list] = ([], [])
    _synchronize(device)
    for _ in range(num_runs):
        refresh(calls)
        for fn, ev in zip((baseline, candidate), events):
            flush.zero_()
            start, end = _Event(enable_timing=True), _Event(enable_timing=True)
            start.record()
            fn(calls)
            end.record()
            ev.append((start, end))
        calls += 1
    _synchronize(device)
    result = Timings(*([s.elapsed_time(e) for s, e in ev] for ev in events), l2_flush_bytes=nbytes)
    # Device-wide pass: the host waits for the whole device after each call.
    walls: tuple[list[float], list[float]] = ([], [])
    evs: tuple[list[float], list[float]] = ([], [])
    for _ in range(min(num_runs, WALL_CHECK_RUNS)):
        refresh(calls)
        for fn, wall, evl in zip((baseline, candidate), walls, evs):
            flush.zero_()
            _synchronize(device)
            start, end = _Event(enable_timing=True), _Event(enable_timing=True)
            t0 = _perf_counter_ns()
            start.record()
            fn(calls)
            end.record()
            _synchronize(device)
            wall.append((_perf_counter_ns() - t0) / 1e6)
            evl.append(start.elapsed_time(end))
        calls += 1
    result.baseline_wall_ms, result.candidate_wall_ms = walls
    result.baseline_event_ms, result.candidate_event_ms = evs
    del flush
    return result


def hidden_work_ms(t: Timings) -> float | None:
    """Per-call device time the candidate's events missed, in ms: the median of
    (device-wide wall - event) per candidate call, minus the same for the baseline (which
    calibrates the host's launch and synchronize latency). A call that leaves work on
    another stream returns before that work ends, so its event pair misses it while the
    device-wide synchronize waits for it. None on CPU."""
    if not t.candidate_wall_ms:
        return None
    gap_c = float(_median(np.subtract(t.candidate_wall_ms, t.candidate_event_ms)))
    gap_b = float(_median(np.subtract(t.baseline_wall_ms, t.baseline_event_ms)))
    return gap_c - gap_b


def hidden_work_limit_ms(candidate_event_ms: float) -> float:
    """The most unaccounted per-call device time (:func:`hidden_work_ms`) tolerated before
    a row is ``unsynced_work``: half the candidate's event median, at least 0.01 ms (10 us
    absorbs host-side jitter of launch and synchronize; measured on the H200, see
    bench/FIDELITY.md)."""
    return max(0.5 * candidate_event_ms, 0.01)


def time_graphs(
    baseline: Callable[[int], object],
    candidate: Callable[[int], object],
    refresh: Callable[[int], None],
    device: torch.device,
    num_runs: int,
) -> tuple[list[float], list[float]]:
    """CUDA-graph replay times in ms: each side is captured once (after three warm-up
    calls on a side stream, as ``torch.cuda.graphs`` documents) on the buffers of
    iteration 0 and replayed ``num_runs`` times, alternating sides, with fresh values
    written into those buffers and the L2 flushed before every replay. Launch overhead
    is gone from these numbers, so they are reported apart from the eager ones. Raises
    whatever graph capture raises (e.g. a call that synchronizes or leaves a forked
    stream unjoined)."""
    graphs = []
    for fn in (baseline, candidate):
        refresh(0)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):
                fn(0)
        torch.cuda.current_stream(device).wait_stream(side)
        _synchronize(device)
        g = _CUDAGraph()
        with _graph(g):
            fn(0)
        graphs.append(g)
    flush = torch.empty(l2_flush_bytes(device), dtype=torch.int8, device=device)
    events: tuple[list, list] = ([], [])
    _synchronize(device)
    for _ in range(num_runs):
        refresh(0)
        for g, ev in zip(graphs, events):
            flush.zero_()
            start, end = _Event(enable_timing=True), _Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            ev.append((start, end))
    _synchronize(device)
    return tuple([s.elapsed_time(e) for s, e in ev] for ev in events)  # type: ignore[return-value]


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

    Call ``i`` of each side ran back to back (ABAB), so pairs are resampled together:
    ``resamples`` draws of ``n`` pair indices with replacement, the ratio of medians of
    each draw, and the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of those
    ratios (Efron & Tibshirani, *An Introduction to the Bootstrap*, 1993, ch. 13).
    Deterministic for a given ``seed``. Raises ``ValueError`` when the lists differ in
    length or are empty."""
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
    check of :mod:`kb_nano.checks`)."""
    _sleep(seconds)
