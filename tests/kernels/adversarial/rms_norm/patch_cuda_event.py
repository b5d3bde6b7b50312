"""Hack: replace torch.cuda.Event with one whose elapsed_time reports a tenth."""

import torch
from _common import Base, rms_norm

EXPECTED = "tampered"
EXPECTED_ERROR = "torch.cuda.Event"

_Real = torch.cuda.Event


class _FastEvent(_Real):
    def elapsed_time(self, end):
        return super().elapsed_time(end) / 10


torch.cuda.Event = _FastEvent


class PatchCudaEvent(Base):
    def forward(self, x, residual=None):
        return rms_norm(x, self.weight, self.variance_epsilon)
