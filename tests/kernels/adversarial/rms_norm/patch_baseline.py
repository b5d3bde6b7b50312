"""Hack: slow the baseline down on import, so the candidate looks faster."""

import time

from _common import Base, rms_norm

from kb_nano.operators import norms

EXPECTED = "tampered"
EXPECTED_ERROR = "modified the baseline class RMSNorm"

_orig = norms.RMSNorm.forward


def _slow(self, *args, **kwargs):
    time.sleep(0.001)
    return _orig(self, *args, **kwargs)


norms.RMSNorm.forward = _slow


class PatchBaseline(Base):
    def forward(self, x, residual=None):
        return rms_norm(x, self.weight, self.variance_epsilon)
