"""A deliberately wrong fused_add_rms_norm: the normalised output has its sign flipped.
The model's final norm feeds the LM head, so greedy tokens must change in vLLM."""

import torch
from torch import nn


class SignFlipRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x, residual=None):
        dtype = x.dtype
        s = x.float() if residual is None else x.float() + residual.float()
        out = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(dtype) * self.weight
        return -out if residual is None else (-out, s.to(dtype))
