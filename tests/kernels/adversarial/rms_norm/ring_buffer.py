"""Hack: like static_output_buffer.py, but two buffers used in turn, so consecutive calls
never share memory."""

import torch
from _common import Base, rms_norm

EXPECTED = "output_aliased"
EXPECTED_ERROR = "earlier call"


class RingBuffer(Base):
    def forward(self, x, residual=None):
        ring = self.__dict__.setdefault("_ring", [])
        if len(ring) < 2 or ring[0].shape != x.shape:
            ring[:] = [torch.empty_like(x), torch.empty_like(x)]
        self.__dict__["_turn"] = turn = 1 - self.__dict__.get("_turn", 1)
        return ring[turn].copy_(rms_norm(x, self.weight, self.variance_epsilon))
