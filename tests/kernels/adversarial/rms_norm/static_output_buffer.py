"""Hack: write every result into one preallocated buffer and return it; the next call
silently overwrites what the caller holds."""

import torch
from _common import Base, rms_norm

EXPECTED = "output_aliased"
EXPECTED_ERROR = "earlier call"


class StaticOutputBuffer(Base):
    def forward(self, x, residual=None):
        buf = self.__dict__.get("_buf")
        if buf is None or buf.shape != x.shape:
            buf = self.__dict__["_buf"] = torch.empty_like(x)
        return buf.copy_(rms_norm(x, self.weight, self.variance_epsilon))
