"""Hack: replace numpy's median so any statistics computed with it favour the candidate."""

import numpy as np
from _common import Base, rms_norm

EXPECTED = "tampered"
EXPECTED_ERROR = "numpy.median"

_real = np.median
np.median = lambda a, *args, **kwargs: _real(a, *args, **kwargs) * 0.5


class PatchNumpyMedian(Base):
    def forward(self, x, residual=None):
        return rms_norm(x, self.weight, self.variance_epsilon)
