"""Hack (or a common bug): an RMS norm without eps, ``x * rsqrt(mean(x^2))``, one add
fewer and one constant fewer than the baseline; on random N(0, 1) rows it agrees with the
baseline to ~1e-5, far inside the bf16 tolerance.

Why it is stopped: the norm operators get edge-case correctness trials
(kb_nano.kernels.inputs.EDGE_CASES); in ``zero_row`` row 0 is all zeros, where
``rsqrt(0) = inf`` and ``0 * inf = NaN`` while the baseline returns zeros: ``nonfinite``."""

import torch
from _common import Base

EXPECTED = "nonfinite"
EXPECTED_ERROR = "zero_row"


class NoEpsNorm(Base):
    def forward(self, x, residual=None):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True))).to(x.dtype) * self.weight
