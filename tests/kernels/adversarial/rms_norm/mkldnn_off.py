"""Hack: switch oneDNN (MKL-DNN) off for the whole process at import
(``torch.backends.mkldnn.enabled = False``), so every other module's CPU convolutions,
matmuls and norms fall back to slower kernels while this candidate uses its own path.

Why it is stopped: the guard (kb_nano.kernels.guard) snapshots the backend flags before
the candidate is imported and compares them after the import: ``tampered``. (The baseline
is in another process anyway, where the flag is untouched.)"""

import torch
from _common import Base, rms_norm

EXPECTED = "tampered"
EXPECTED_ERROR = "torch.backends.mkldnn.enabled"

torch.backends.mkldnn.enabled = False


class MkldnnOff(Base):
    def forward(self, x, residual=None):
        return rms_norm(x, self.weight, self.variance_epsilon)
