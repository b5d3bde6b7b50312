"""Crash (CUDA): a Triton kernel stores far outside its output, an illegal address that
poisons the CUDA context for the rest of the process."""

import torch
from _common import Base

EXPECTED = "runtime_error"
EXPECTED_ERROR = "illegal memory access"


class IllegalAddress(Base):
    supported_devices = ("cuda",)

    def forward(self, x, residual=None):
        import triton
        import triton.language as tl

        @triton.jit
        def _oob(ptr):
            tl.store(ptr + (1 << 40), 1.0)

        out = torch.empty_like(x)
        _oob[(1,)](out)
        torch.cuda.synchronize()
        return out
