"""qk_norm with ``torch.nn.functional.rms_norm`` (one fused reduction per head) instead of
the baseline's pow / mean / rsqrt / mul chain, for q and k; also Llama-4's weightless
norm (``has_weight=False``: semantics ``no_weight``)."""

import torch
import torch.nn.functional as F
from torch import nn


class FusedRMSQKNorm(nn.Module):
    """Same constructor, forward and state_dict (``q_norm.weight``, ``k_norm.weight``) as
    kb_nano's QKNorm baseline (no state without a weight).

    Forward: q ``[N, num_heads * head_dim]``, k ``[N, num_kv_heads * head_dim]`` -> ``(q, k)``.
    """

    supported_semantics = ("no_weight",)

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, eps: float = 1e-6, has_weight: bool = True
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.eps = eps
        self.q_norm = nn.Module()
        self.k_norm = nn.Module()
        if has_weight:
            self.q_norm.weight = nn.Parameter(torch.ones(head_dim))
            self.k_norm.weight = nn.Parameter(torch.ones(head_dim))

    def _norm(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        heads = x.view(*x.shape[:-1], -1, self.head_dim).float()
        # normalise in fp32, round to the input dtype, then scale in that dtype (as the baseline)
        out = F.rms_norm(heads, (self.head_dim,), None, self.eps).to(x.dtype)
        weight = getattr(norm, "weight", None)
        return (out if weight is None else out.mul_(weight)).view(x.shape)

    def forward(self, q: torch.Tensor, k: torch.Tensor):
        return self._norm(q, self.q_norm), self._norm(k, self.k_norm)
