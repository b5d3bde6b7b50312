"""Hack (CUDA): launch the work on a side stream and return; events recorded on the
default stream stop before the work ends."""

import torch

from _common import Base, rms_norm

EXPECTED = "unsynced_work"


class SideStream(Base):
    supported_devices = ("cuda",)

    def forward(self, x, residual=None):
        side = self.__dict__.setdefault("_stream", torch.cuda.Stream())
        out = torch.empty_like(x)
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000)  # make the hidden part long enough to matter (~0.1 ms)
            out.copy_(rms_norm(x, self.weight, self.variance_epsilon))
        return out
