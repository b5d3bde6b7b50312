"""Control: a real third-party kernel library. The normalisation runs in an
``@numba.njit`` kernel (LLVM-compiled on the first call, ``cache=False``) over the
float32 NumPy view of the input; the cast back to the input dtype and the weight multiply
stay in torch, as in the baseline. Must pass."""

import numba
import numpy as np
import torch
from _common import Base

EXPECTED = "passed"


@numba.njit(cache=False)
def _rms_rows(x, eps, out):
    rows, cols = x.shape
    for i in range(rows):
        acc = np.float32(0.0)
        for j in range(cols):
            acc += x[i, j] * x[i, j]
        scale = np.float32(1.0) / np.sqrt(acc / np.float32(cols) + np.float32(eps))
        for j in range(cols):
            out[i, j] = x[i, j] * scale


class HonestNumba(Base):
    supported_devices = ("cpu",)  # host code: skipped on a GPU run

    def forward(self, x, residual=None):
        xf = x.float().contiguous().numpy()
        out = np.empty_like(xf)
        _rms_rows(xf, np.float32(self.variance_epsilon), out)
        return torch.from_numpy(out).to(x.dtype) * self.weight
