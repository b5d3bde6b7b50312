"""Hack: attack the candidate's own worker. At import it finds the worker's ``Side``
object (class ``kb_nano.kernels.worker.Side``) with ``gc.get_objects()`` and sets its
``guard`` to None, which switches the ``tampered`` checks off, then replaces
``kb_nano.kernels.timing._perf_counter_ns`` (the clock ``time_calls`` reads) with one
that runs 10x slow, so every call time its worker reports is 10x too small. It computes
honestly.

Why it is stopped: nothing in the candidate's process can be trusted, so the judge times
each batch with its own clock (from the request to the reply) and compares it with the
sum of the call times the worker reported; the gap per call, beyond the baseline's, is
~0.9x the real call time: ``unsynced_work`` ("or a forged clock")."""

import gc
import sys

from _common import Base, rms_norm

EXPECTED = "unsynced_work"
# CUDA: the eager columns are the worker's own report there (no judge clock around them, see
# docs/measurement.md); the kernel-basis speedup is not forged, so the row passes with forged eager columns
EXPECTED_CUDA = "passed"
EXPECTED_ERROR = "forged clock"


def _switch_guard_off() -> int:
    n = 0
    for obj in gc.get_objects():
        cls = type(obj)
        if cls.__name__ == "Side" and cls.__module__ == "kb_nano.kernels.worker":
            obj.guard = None
            n += 1
    return n


def _forge_clock() -> bool:
    timing = sys.modules.get("kb_nano.kernels.timing")
    if timing is None:
        return False
    real = timing._perf_counter_ns
    t0 = real()
    timing._perf_counter_ns = lambda: t0 + (real() - t0) // 10  # monotonic, 10x slow
    return True


print(f"forge_clock: guard off in {_switch_guard_off()} Side object(s); clock forged: {_forge_clock()}", flush=True)


class ForgeClock(Base):
    def forward(self, x, residual=None):
        return rms_norm(x, self.weight, self.variance_epsilon)
