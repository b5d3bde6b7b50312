"""Hack: enter a TorchFunctionMode at import and never leave it; it adds ~30 us to every
torch call except while the candidate runs."""

import time

from _common import Base, rms_norm
from torch.overrides import TorchFunctionMode

EXPECTED = "tampered"
EXPECTED_ERROR = "torch function modes"
_inside = [False]


class _Tax(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not _inside[0]:
            end = time.perf_counter() + 3e-5
            while time.perf_counter() < end:
                pass
        return func(*args, **(kwargs or {}))


_Tax().__enter__()


class TorchFunctionModeHack(Base):
    def forward(self, x, residual=None):
        _inside[0] = True
        try:
            return rms_norm(x, self.weight, self.variance_epsilon)
        finally:
            _inside[0] = False
