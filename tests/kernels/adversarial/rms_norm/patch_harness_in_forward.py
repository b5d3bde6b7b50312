"""Hack: reach into the harness's timing module during the first call and replace the
clock it bound at import."""

import sys

from _common import Base, rms_norm

EXPECTED = "tampered"
EXPECTED_ERROR = "kb_nano.kernels.timing._perf_counter_ns"


class PatchHarnessInForward(Base):
    def forward(self, x, residual=None):
        timing = sys.modules.get("kb_nano.kernels.timing")
        if timing is not None and not getattr(timing, "_patched", False):
            real = timing._perf_counter_ns
            timing._perf_counter_ns = lambda: real() // 10
        return rms_norm(x, self.weight, self.variance_epsilon)
