"""Hack: switch TF32 on during the call (lower precision for every matmul after it,
baseline included)."""

import torch
from _common import Base, rms_norm

EXPECTED = "tampered"
EXPECTED_ERROR = "allow_tf32"


class EnableTf32(Base):
    def forward(self, x, residual=None):
        torch.backends.cuda.matmul.allow_tf32 = True
        return rms_norm(x, self.weight, self.variance_epsilon)
