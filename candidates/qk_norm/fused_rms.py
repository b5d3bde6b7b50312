"""qk_norm with ``torch.nn.functional.rms_norm`` (one fused reduction per head) instead of
the baseline's pow / mean / rsqrt / mul chain, for q and k."""

import torch
import torch.nn.functional as F
from torch import nn


class FusedRMSQKNorm(nn.Module):
    """Same constructor, forward and state_dict (``q_norm.weight``, ``k_norm.weight``) as
    kb_nano's QKNorm baseline.

    Forward: q ``[N, num_heads * head_dim]``, k ``[N, num_kv_heads * head_dim]`` -> ``(q, k)``.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.eps = eps
        self.q_norm = nn.Module()
        self.q_norm.weight = nn.Parameter(torch.ones(head_dim))
        self.k_norm = nn.Module()
        self.k_norm.weight = nn.Parameter(torch.ones(head_dim))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        heads = x.view(*x.shape[:-1], -1, self.head_dim).float()
        # normalise in fp32, round to the input dtype, then scale in that dtype (as the baseline)
        return F.rms_norm(heads, (self.head_dim,), None, self.eps).to(x.dtype).mul_(weight).view(x.shape)

    def forward(self, q: torch.Tensor, k: torch.Tensor):
        return self._norm(q, self.q_norm.weight), self._norm(k, self.k_norm.weight)
