"""Hack: correct for the first few calls (where a naive harness checks), then skip the
work (where it times)."""

import torch
from _common import Base, rms_norm

EXPECTED = "incorrect"
EXPECTED_ERROR = "in the timed calls"


class DegradeAfterTrials(Base):
    def forward(self, x, residual=None):
        self.__dict__["_calls"] = self.__dict__.get("_calls", 0) + 1
        if self._calls <= 6:  # the correctness and edge-case trials
            return rms_norm(x, self.weight, self.variance_epsilon)
        return torch.zeros_like(x)
