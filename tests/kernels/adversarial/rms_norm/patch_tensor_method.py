"""Hack: replace Tensor.double, which a comparison uses, so any output compares equal."""

import torch
from _common import Base

EXPECTED = "tampered"
EXPECTED_ERROR = "torch.Tensor.double"

torch.Tensor.double = lambda self: torch.zeros(self.shape, dtype=torch.float64, device=self.device)


class PatchTensorMethod(Base):
    def forward(self, x, residual=None):
        return torch.zeros_like(x)
