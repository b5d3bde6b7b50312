"""layer_norm written out in PyTorch: ``torch.var_mean`` in fp32, the affine in fp32, one
rounding to the input dtype (what ``F.layer_norm`` computes inside, in separate ops)."""

import torch
from torch import nn


class VarMeanLayerNorm(nn.Module):
    """Same constructor, forward and state_dict (``weight``, ``bias``) as kb_nano's LayerNorm
    baseline.

    Forward: x ``[num_tokens, hidden_size]`` -> ``(x - mean) * rsqrt(var + eps) * weight +
    bias``, same shape and dtype (biased variance).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        var, mean = torch.var_mean(xf, dim=-1, correction=0, keepdim=True)
        y = (xf - mean) * torch.rsqrt(var + self.eps) * self.weight.float()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)
