"""Hack: make torch.cuda.synchronize a no-op, so a harness that waits on it stops early."""

import torch
from _common import Base, rms_norm

EXPECTED = "tampered"
EXPECTED_ERROR = "torch.cuda.synchronize"

torch.cuda.synchronize = lambda device=None: None


class PatchSynchronize(Base):
    def forward(self, x, residual=None):
        return rms_norm(x, self.weight, self.variance_epsilon)
