"""Hack: slow down every torch module call but its own (the baseline is an nn.Module)."""

import time

import torch
from _common import Base, rms_norm

EXPECTED = "tampered"
EXPECTED_ERROR = "torch.nn.Module"

_real_call = torch.nn.Module.__call__


def _slow_call(self, *args, **kwargs):
    if type(self).__name__ != "PatchModuleCall":
        time.sleep(0.001)
    return _real_call(self, *args, **kwargs)


torch.nn.Module.__call__ = _slow_call


class PatchModuleCall(Base):
    def forward(self, x, residual=None):
        return rms_norm(x, self.weight, self.variance_epsilon)
