"""The kernel timer: the GPU time of the kernels one call runs, from CUPTI activity records.

A batch of calls runs while CUPTI's activity API records kernels, copies and memsets
(:mod:`kb_nano.kernels.cupti_lib`). Before each call the L2 is flushed on the flush's own stream
(:class:`kb_nano.kernels.timing.L2Flush`), ordered with the current stream both ways, so
on the device the batch is ``flush_1, call_1, flush_2, call_2, ...``. The records are then
split at the flushes (:func:`attribute`): every record that is not the flush's and starts
after flush ``i`` ends and before flush ``i + 1`` starts belongs to call ``i`` (on any
stream: work a call leaves on a side stream is counted), and a call's kernel time is the
union of its records' intervals (kernels, copies and memsets; concurrent kernels counted
once, the gaps between them not at all: ncu's ``gpu__time_duration`` summed over the
call's kernels). Anything that starts before the first flush ends ran outside every call
(work left running from before the batch) and is reported as hidden work.

The outputs are handed to the judge only after the profiled loop, so the copies that do
that are not in the records. Host launch time is in no record: that is the eager timer's
business (:func:`kb_nano.kernels.timing.time_calls`).

CUPTI is set up when the worker starts (its CUDA context exists, no candidate code has
run): 0.02 s. The flush's stream and record names are learnt at the first timed batch,
from one flush recorded alone.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from kb_nano.kernels.cupti_lib import ActivityTrace
from kb_nano.kernels.timing import L2Flush, _synchronize


class KernelTimeError(Exception):
    """The records cannot be split into calls (another call's work on the flush's
    stream: ``foreign_work``; a flush missing)."""

    def __init__(self, message: str, foreign_work: bool = False) -> None:
        super().__init__(message)
        self.foreign_work = foreign_work


def attribute(
    records: list[tuple[int, str, int, int]], flush_stream: int, flush_names: frozenset, calls: int
) -> tuple[list[tuple[float, float, int]], float]:
    """Split the GPU records of one profiled batch into its calls.

    ``records``: ``(stream, name, start_ns, end_ns)`` of every GPU activity record
    (kernel, memcpy, memset) of the batch; ``flush_stream``: the CUPTI stream id of the
    flush; ``flush_names``: the names of the flush's records (learnt alone, see
    :class:`KernelTimer`); ``calls``: how many flush + call pairs ran.

    Returns ``(per_call, hidden_ms)``: per call ``(kernel_ms, span_ms, n_records)`` (the
    union of its records' intervals, the first start to the last end, and the record
    count), and the busy time (union, ms) of records that started before the first flush
    ended. Raises :class:`KernelTimeError` when the flush stream holds a record with
    another name (a call's work there would be taken for the flush) or the flushes are not
    ``calls`` groups."""
    flush = sorted((r for r in records if r[0] == flush_stream), key=lambda r: r[2])
    alien = [r[1] for r in flush if r[1] not in flush_names]
    if alien:
        raise KernelTimeError(f"GPU work on the harness's flush stream: {alien[0][:80]!r}", foreign_work=True)
    per_flush = len(flush) // max(calls, 1)
    if calls <= 0 or per_flush == 0 or per_flush * calls != len(flush):
        raise KernelTimeError(f"{len(flush)} flush records for {calls} calls")
    # flush i = its records, in launch order; a record belongs to the call after the last
    # flush that ended before the record started
    ends = [max(r[3] for r in flush[i * per_flush : (i + 1) * per_flush]) for i in range(calls)]
    buckets: list[list[tuple[int, int]]] = [[] for _ in range(calls)]
    early: list[tuple[int, int]] = []
    for stream, _, start, end in records:
        if stream == flush_stream:
            continue
        i = bisect.bisect_right(ends, start) - 1
        (early if i < 0 else buckets[i]).append((start, end))
    per_call = []
    for b in buckets:
        if not b:
            per_call.append((0.0, 0.0, 0))
            continue
        per_call.append((union_ns(b) / 1e6, (max(e for _, e in b) - min(s for s, _ in b)) / 1e6, len(b)))
    return per_call, union_ns(early) / 1e6


def union_ns(intervals: list[tuple[int, int]]) -> int:
    """Total length of the union of ``(start, end)`` intervals (ns)."""
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


class KernelTimer:
    """CUPTI kernel time of calls on ``device`` (see the module docstring); ``flush`` is
    the worker's :class:`~kb_nano.kernels.timing.L2Flush`. Sets CUPTI up at once (the
    worker's CUDA context must exist); without CUPTI, :attr:`error` says why and every
    :meth:`time_calls` returns it. Learns the flush's CUPTI stream id and record names at
    the first :meth:`time_calls`."""

    def __init__(self, device: torch.device, flush: L2Flush) -> None:
        self.device, self.flush = device, flush
        self.flush_stream: int | None = None
        self.flush_names: frozenset = frozenset()
        self.error: str | None = None
        self.trace: ActivityTrace | None = None
        try:
            self.trace = ActivityTrace()
        except Exception as exc:  # noqa: BLE001 - no CUPTI here: the kernel columns stay empty, the row says why
            self.error = f"CUPTI kernel timing unavailable: {type(exc).__name__}: {str(exc)[:200]}"

    def _record(self, work: Callable[[], list]) -> tuple[list, list[tuple[int, str, int, int]]]:
        """``work()`` (synchronized after) with CUPTI recording; its result and the records."""
        self.trace.start()
        try:
            out = work()
            _synchronize(self.device)
        finally:
            records = self.trace.stop()
        return out, records

    def _learn(self) -> None:
        """The flush's CUPTI stream id and record names: one flush recorded alone (in the
        request thread, when the worker runs nothing else)."""
        _, recs = self._record(lambda: [self.flush()])
        if not recs or len({r[0] for r in recs}) != 1:
            raise KernelTimeError(
                f"the flush alone gave {len(recs)} GPU records on {len({r[0] for r in recs})} "
                "streams (other GPU work in the worker while it was learnt)"
            )
        self.flush_stream, self.flush_names = recs[0][0], frozenset(r[1] for r in recs)

    def time_calls(self, call: Callable[[int], object], slots: range, after: Callable[[int, object], None]) -> dict:
        """Record one flush + call per slot; then ``after(i, out)`` for each (untimed,
        outside the recording). Returns ``{"times_ms", "span_ms", "kernels", "hidden_ms"}``
        (per call: kernel ms, first-start-to-last-end ms, record count) or
        ``{"kernel_error": why, "foreign_work": bool}``."""
        if self.error:
            return {"kernel_error": self.error}
        if self.flush_stream is None:
            try:
                self._learn()
            except KernelTimeError as exc:
                return {"kernel_error": str(exc)}

        def calls() -> list:
            outs = []
            for i in slots:
                self.flush()
                outs.append(call(i))
            return outs

        outs, records = self._record(calls)
        try:
            per_call, hidden = attribute(records, self.flush_stream, self.flush_names, len(slots))
        except KernelTimeError as exc:
            return {"kernel_error": str(exc), "foreign_work": exc.foreign_work}
        for i, out in zip(slots, outs):
            after(i, out)
        return {
            "times_ms": [p[0] for p in per_call],
            "span_ms": [p[1] for p in per_call],
            "kernels": [p[2] for p in per_call],
            "hidden_ms": hidden,
        }
