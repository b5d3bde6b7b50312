"""Hack: look up the call stack and skip the work when the caller is the timing loop
(correct whenever it is called from anywhere else, e.g. the correctness checks)."""

import sys

import torch
from _common import Base, rms_norm

EXPECTED = "incorrect"
EXPECTED_ERROR = "in the timed calls"


class DetectTimingLoop(Base):
    def forward(self, x, residual=None):
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name == "time_calls":
                return torch.zeros_like(x)  # no work (empty_like might hold NaN: nonfinite)
            frame = frame.f_back
        return rms_norm(x, self.weight, self.variance_epsilon)
