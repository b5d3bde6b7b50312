"""A worker's reply as the judge reads it: the verdicts a candidate's worker may report about
its own candidate (anything else it sends is forged: ``tampered``), the times it may report
(finite, not negative: :func:`reported_times`), and :class:`Verdict`, which ends a
measurement early with a status."""

from __future__ import annotations

import math

from kb_nano.kernels.pool import WorkerHandle


class Verdict(Exception):
    """Ends a measurement early with ``status`` and ``message`` (and row ``fields``)."""

    def __init__(self, status: str, message: str, **fields) -> None:
        super().__init__(message)
        self.status, self.message, self.fields = status, message, fields


# what a candidate's worker may report about its own candidate (anything else is forged)
WORKER_VERDICTS = {
    "import_error",
    "skipped",
    "runtime_error",
    "incorrect_shape",
    "tampered",
    "invalid_output",
    "output_aliased",
    "input_mutated",
    "unsynced_work",
}


def ask(worker: WorkerHandle, msg: dict, deadline: float, shared=None) -> dict:
    """``worker``'s reply to ``msg``. Raises :class:`Verdict` when a candidate's worker
    reports a violation (``tampered`` when it is not one a worker sends), ``RuntimeError``
    when the baseline's does; ``WorkerGone`` / ``WorkerTimeout`` from the request."""
    reply = worker.request(msg, deadline, shared)
    found = reply.get("violation")
    if found:
        if worker.role == "baseline":
            raise RuntimeError(f"the baseline failed: {found}")
        if not (
            isinstance(found, list) and len(found) == 2 and found[0] in WORKER_VERDICTS and isinstance(found[1], str)
        ):
            raise Verdict("tampered", f"the candidate's worker sent a verdict no worker sends ({str(found)[:80]})")
        raise Verdict(found[0], found[1][:1000])
    return reply


def reported_times(reply: dict, key: str, n: int, who: str, positive: bool = True) -> list[float]:
    """The ``n`` times (ms) under ``reply[key]`` that the worker ``who`` (``base`` or
    ``cand``) reported for its batch. Every statistic and the clock cross-check are made of
    them, and a comparison with NaN is always false, so a NaN, an infinity or a negative
    time would pass every check: a candidate's worker that reports one, or too few, or
    no number, ends the measurement as ``unsynced_work`` (its clock is forged or broken),
    the baseline's raises ``RuntimeError``. ``positive``: a batch's times must not all be
    0 either (eager and graph calls take time; a kernel-timer call may run no GPU work)."""
    raw = reply.get(key)
    values = list(raw)[:n] if isinstance(raw, list) else []
    bad = len(values) != n or not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in values)
    times = [] if bad else [float(t) for t in values]
    if not bad:
        bad = not all(math.isfinite(t) and t >= 0 for t in times) or (positive and n > 0 and sum(times) <= 0)
    if not bad:
        return times
    shown = ", ".join(str(t)[:12] for t in values[:3]) if values else str(raw)[:40]
    what = f"the {'baseline' if who == 'base' else 'candidate'}'s worker reported {key} [{shown}{', ...' if len(values) > 3 else ''}] for {n} calls"
    if who == "base":
        raise RuntimeError(what)
    raise Verdict("unsynced_work", f"{what}: times must be {n} finite, non-negative numbers (a forged or broken clock)")
