"""Hack: compute honestly, but register a global nn.Module forward pre-hook that makes
every other module (the baseline) wait 0.2 ms per call."""

import time

import torch
from _common import Base, rms_norm

EXPECTED = "tampered"
EXPECTED_ERROR = "_global_forward_pre_hooks"


def _slow(module, args):
    if type(module).__name__ != "GlobalForwardHook":
        end = time.perf_counter() + 0.0002
        while time.perf_counter() < end:
            pass


torch.nn.modules.module.register_module_forward_pre_hook(_slow)


class GlobalForwardHook(Base):
    def forward(self, x, residual=None):
        return rms_norm(x, self.weight, self.variance_epsilon)
