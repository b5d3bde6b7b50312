"""Hack: move the work out of the timed window into the worker's untimed output copy.
At import it finds the worker's ``Side`` object via ``gc`` and sets its ``guard`` to None
(no ``tampered`` checks), then replaces ``Side.keep`` (called by ``time_calls`` after the
clock stops, to copy each output into the judge's slot) with a wrapper that first
computes the real result into the buffer the call returned. ``forward`` itself, when
``time_calls`` is on its call stack, stashes ``x`` and returns ``torch.empty_like(x)``
(no work: the timed call costs an allocation); outside ``time_calls`` (the correctness
trials) it computes honestly. Every output the judge sees is right.

Why it is stopped: the judge's clock runs around the whole batch (the request to the
reply), so the work moved into ``keep`` is still inside it; the gap between that clock
and the call times the worker reported exceeds the baseline's by about the real call
time: ``unsynced_work``."""

import gc
import sys

import torch
from _common import Base, rms_norm

EXPECTED = "unsynced_work"
EXPECTED_ERROR = "work outside the timed calls"

_PENDING: dict = {}  # id(returned buffer) -> (buffer, x, module)


def _find_sides() -> list:
    return [
        o for o in gc.get_objects() if type(o).__name__ == "Side" and type(o).__module__ == "kb_nano.kernels.worker"
    ]


def _patch_keep() -> bool:
    worker = sys.modules.get("kb_nano.kernels.worker")
    if worker is None:
        return False
    for side in _find_sides():
        side.guard = None
    real_keep = worker.Side.keep

    def keep(self, k, out):
        job = _PENDING.pop(id(out), None)
        if job is not None and job[0] is out:  # untimed: do the work now
            _, x, module = job
            out.copy_(rms_norm(x, module.weight, module.variance_epsilon))
        return real_keep(self, k, out)

    worker.Side.keep = keep
    return True


def _in_time_calls() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "time_calls":
            return True
        frame = frame.f_back
    return False


print(f"defer_to_copy: keep patched: {_patch_keep()}", flush=True)


class DeferToCopy(Base):
    def forward(self, x, residual=None):
        if _in_time_calls():
            out = torch.empty_like(x)
            _PENDING[id(out)] = (out, x, self)
            return out
        return rms_norm(x, self.weight, self.variance_epsilon)
