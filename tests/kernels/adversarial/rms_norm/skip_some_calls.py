"""Hack: correct for the first 8 calls (the correctness and edge-case trials and the
warm-up), then skip the work (zeros) on every third call, betting that a harness checks
only a sample of its timed calls and that a third of the calls being nearly free lowers
the median enough.

Why it is stopped: the judge compares the output of every timed call with the
baseline's: the first skipped call makes the row ``incorrect`` ("in the timed calls")."""

import torch
from _common import Base, rms_norm

EXPECTED = "incorrect"
EXPECTED_ERROR = "in the timed calls"


class SkipSomeCalls(Base):
    def forward(self, x, residual=None):
        calls = self.__dict__["_calls"] = self.__dict__.get("_calls", 0) + 1
        if calls > 8 and calls % 3 == 0:
            return torch.zeros_like(x)  # no work (empty_like might hold NaN: nonfinite)
        return rms_norm(x, self.weight, self.variance_epsilon)
