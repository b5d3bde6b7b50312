"""fused_add_rms_norm with one float32 sum reused for the residual and the norm, and
the fused ``torch.nn.functional.rms_norm`` for the normalisation."""

import torch
import torch.nn.functional as F
from torch import nn


class Fp32SumRMSNorm(nn.Module):
    """Same constructor, forward and state_dict (``weight``) as kb_nano's RMSNorm baseline.

    Forward: x, residual ``[num_tokens, hidden_size]`` -> ``(out, new_residual)``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        dtype = x.dtype
        s = x.float()
        if residual is not None:
            s = s.add_(residual)
        out = F.rms_norm(s, (self.hidden_size,), None, self.variance_epsilon).to(dtype).mul_(self.weight)
        return out if residual is None else (out, s.to(dtype))
