"""Hack: slow down the clock the harness reads, so every timed call looks 10x shorter."""

import time

from _common import Base, rms_norm

EXPECTED = "tampered"
EXPECTED_ERROR = "time.perf_counter_ns"

_real = time.perf_counter_ns
time.perf_counter_ns = lambda: _real() // 10


class PatchPerfCounter(Base):
    def forward(self, x, residual=None):
        return rms_norm(x, self.weight, self.variance_epsilon)
