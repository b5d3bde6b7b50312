"""Hack: forge the reported call times in all timed batches but one. At import it
switches its worker's guard off (through ``gc``, a documented gap) and wraps
``kb_nano.kernels.timing.time_calls`` to report 0.3x the measured times in every timed
batch except the fourth. When the judge's clock cross-check took the least
(judge - reported) gap over batches, that one honest batch vouched for the nine forged ones
and the row passed at 3.3x (a breaker pass on the 2-core CPU); it now takes the median."""

import gc
import sys

from kb_nano.operators.norms import RMSNorm as _R

EXPECTED = "unsynced_work"
# CUDA: the eager columns are the worker's own report there (no judge clock around them, see
# docs/measurement.md); the kernel-basis speedup is not forged, so the row passes with forged eager columns
EXPECTED_CUDA = "passed"

for obj in gc.get_objects():
    if type(obj).__name__ == "Side" and type(obj).__module__ == "kb_nano.kernels.worker":
        obj.guard = None

_timing = sys.modules["kb_nano.kernels.timing"]
_real = _timing.time_calls
_n = [0]


def _forged(call, slots, device, flush, after):
    times = _real(call, slots, device, flush, after)
    if after.__name__ == "_drop":  # warm-up
        return times
    _n[0] += 1
    return times if _n[0] == 4 else [t * 0.3 for t in times]


_timing.time_calls = _forged


class ForgeButOne(_R):
    pass
