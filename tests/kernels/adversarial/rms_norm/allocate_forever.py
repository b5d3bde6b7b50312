"""Crash: allocate 256 MiB blocks on the input's device until the allocator fails
(the CPU worker's address space is capped by ``memory_limit_gb``; a GPU runs out of
device memory)."""

import torch
from _common import Base

EXPECTED = "runtime_error"


class AllocateForever(Base):
    def forward(self, x, residual=None):
        hoard = []
        while True:
            hoard.append(torch.empty(256 << 20, dtype=torch.uint8, device=x.device))
