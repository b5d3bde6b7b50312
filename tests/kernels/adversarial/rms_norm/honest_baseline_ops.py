"""Control: the baseline's own ops (float32 variance, rsqrt, cast, weight), one call per
slot, nothing shared between calls: the honest twin of ``shift_work.py``. Must pass."""

import torch
from _common import Base

EXPECTED = "passed"


class HonestBaselineOps(Base):
    def forward(self, x, residual=None):
        xf = x.float()
        v = xf.pow(2).mean(dim=-1, keepdim=True)
        return (xf * torch.rsqrt(v + self.variance_epsilon)).to(x.dtype) * self.weight
