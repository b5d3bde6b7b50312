"""Clocks of a worker process, and the statistics the judge computes from them.

Method (docs/measurement.md has the full account):

- Paired A/B in blocks (:mod:`kb_nano.kernels.judge`): the judge alternates a batch of
  calls of the baseline worker and a batch of the candidate worker (ABAB), call ``i`` of
  both batches on the same input values, so drift hits both sides alike. A block holds one
  such pair per timer; the interval is over blocks (:func:`speedup_interval`), so it covers
  what changes between blocks, not only between calls.
- Fresh inputs: each call of a batch has its own input slot, and the judge writes
  never-seen values into every slot before every batch (untimed).
- CPU, the eager timer (:func:`time_calls`): ``time.perf_counter_ns`` around each call.
- CUDA, three timers, each with its own columns:
  - eager (:func:`time_calls`): a CUDA event pair around each call on the current stream,
    host launch included, the L2 flushed before each call (:class:`L2Flush`);
  - kernel (:mod:`kb_nano.kernels.cupti`): the GPU time of the kernels one call runs, from
    CUPTI activity records, L2 flushed before each call;
  - graph (:func:`capture_graph`, :func:`time_graph`): the calls of one batch (one per
    input slot, K of them) captured in one CUDA graph; a replay's event time divided by K.
- Statistics: per side the median over blocks of each block's mean call time
  (:func:`kb_nano.kernels.blocks.estimate`), the interquartile range of single calls; the
  speedup is the ratio of the two, its 95% interval the range a rerun's speedup falls in,
  from Student's t over the blocks (:func:`speedup_interval`).

The clock and statistics functions are bound when this module is imported, which a
worker does before it imports any candidate, so a candidate that later replaces
``time.perf_counter_ns``, ``torch.cuda.Event`` or numpy's statistics does not change what
the worker calls (and :mod:`kb_nano.kernels.guard` reports the replacement as
``tampered``). A candidate can still forge what its own worker reports; the judge checks
the reported times against its own clock around each batch
(:func:`kb_nano.kernels.blocks.hidden_ms`).
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter_ns as _perf_counter_ns
from time import sleep as _sleep

import numpy as np
import torch

# Bound at import, before any candidate is imported (see the module docstring).
_Event = torch.cuda.Event
_synchronize = torch.cuda.synchronize
_CUDAGraph = torch.cuda.CUDAGraph
_graph = torch.cuda.graph
_percentile = np.percentile
_median = np.median
_current_stream = torch.cuda.current_stream
_stream = torch.cuda.stream
_sum = torch.sum

DO_BENCH_FLUSH_BYTES = 256 * 1024 * 1024  # triton.testing.do_bench's cache-clearing buffer (256 MiB)


def l2_flush_bytes(device: torch.device) -> int:
    """Bytes read before each timed CUDA call: twice the device's L2 cache
    (``L2_cache_size`` of ``torch.cuda.get_device_properties``; H200: 60 MiB), and at least
    the 256 MiB Triton's ``do_bench`` uses. The floor matters for small kernels: the flush
    keeps the GPU busy while the host launches the timed call (~65 us for 256 MiB on an
    H200), so, as in ``do_bench``, host launch latency up to that long is not counted in
    the eager time (bench/FIDELITY.md). 0 on a CPU (no flush there)."""
    if device.type != "cuda":
        return 0
    l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
    return max(2 * l2, DO_BENCH_FLUSH_BYTES)


class L2Flush:
    """Evicts the L2 cache by *reading* :func:`l2_flush_bytes` bytes (a ``torch.sum`` over a
    float32 buffer), on a stream of its own that waits for the current stream and that the
    current stream then waits for, so the flush runs between two calls and its kernels are
    told apart from the call's by stream (:mod:`kb_nano.kernels.cupti`).

    Reading, not zeroing: a zeroing flush (``do_bench``'s) leaves the L2 full of dirty
    lines whose write-back the next kernel pays. Measured with CUPTI on the H200 (driver
    580.159.04, 2026-12-01; bench/FIDELITY.md has the table from ``bench/fidelity.py``): a
    4096 x 4096 bf16 Triton copy kernel took 79.7 us median after a 256 MiB zeroing flush
    and 70.8 us after reading 256 MiB."""

    mode = "read"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.nbytes = l2_flush_bytes(device)
        self.buffer = torch.zeros(self.nbytes // 4, dtype=torch.float32, device=device)
        self.sink = torch.empty((), dtype=torch.float32, device=device)
        self.stream = torch.cuda.Stream(device)

    def __call__(self) -> None:
        current = _current_stream(self.device)
        self.stream.wait_stream(current)
        with _stream(self.stream):
            _sum(self.buffer, dim=0, out=self.sink)
        current.wait_stream(self.stream)


def time_calls(
    call: Callable[[int], object],
    slots: range,
    device: torch.device,
    flush: L2Flush | None,
    after: Callable[[int, object], None],
) -> list[float]:
    """Time one call per input slot in ``slots``; returns ms per call.

    ``call(i)`` runs the module on slot ``i``; ``after(i, out)`` (untimed) keeps the
    output (copies it to the judge's output slot). CPU: host clock around the call.
    CUDA (the eager timer): ``flush()`` before each call, an event pair around it,
    ``after`` queued on the stream after the end event, one synchronize at the end."""
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
            flush()
        start, end = _Event(enable_timing=True), _Event(enable_timing=True)
        start.record()
        out = call(i)
        end.record()
        after(i, out)
        events.append((start, end))
    _synchronize(device)
    return [s.elapsed_time(e) for s, e in events]


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


def capture_copies(pairs: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device):
    """One CUDA graph of ``dest.copy_(src)`` for each ``(dest, src)`` pair (static
    tensors: a graph's outputs into the judge's slots); replay it to copy them all. None
    when there is nothing to copy."""
    if not pairs:
        return None
    g = _CUDAGraph()
    with _graph(g):
        for dest, src in pairs:
            dest.copy_(src)
    _synchronize(device)
    return g


def time_graph(graph, device: torch.device, flush: L2Flush | None, replays: int = 1) -> float:
    """``replays`` back-to-back replays of ``graph`` in ms (one event pair around them all;
    L2 flushed first; synchronized)."""
    if flush is not None:
        flush()
    start, end = _Event(enable_timing=True), _Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    _synchronize(device)
    return start.elapsed_time(end)


def summarize(times_ms: list[float]) -> tuple[float, float]:
    """Median and interquartile range (p75 - p25) of per-call times, in ms."""
    a = np.asarray(times_ms, dtype=np.float64)
    q25, q50, q75 = _percentile(a, [25, 50, 75])
    return float(q50), float(q75 - q25)


def wait_briefly(seconds: float) -> None:
    """Sleep ``seconds`` with the sleep bound at import (used by the output-stability
    check of :mod:`kb_nano.kernels.checks`)."""
    _sleep(seconds)


def now_ns() -> int:
    """The host clock bound at import (``time.perf_counter_ns``), in ns."""
    return _perf_counter_ns()
