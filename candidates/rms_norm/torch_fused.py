"""rms_norm via the fused ``torch.nn.functional.rms_norm`` (one ATen op instead of
upcast, pow, mean, rsqrt, mul, downcast, mul)."""

import torch
import torch.nn.functional as F
from torch import nn


class FusedRMSNorm(nn.Module):
    """Same constructor, forward and state_dict (``weight``) as kb_nano's RMSNorm baseline."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = (x.float() + residual.float()).to(x.dtype)
            residual = x
        out = F.rms_norm(x, (self.hidden_size,), self.weight, self.variance_epsilon)
        return out if residual is None else (out, residual)
