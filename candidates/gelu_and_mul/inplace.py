"""gelu_and_mul (tanh GELU, Gemma) multiplying in place into the activation of the gate
half: one output allocation instead of two."""

import torch
import torch.nn.functional as F
from torch import nn


class InplaceGeluAndMul(nn.Module):
    """Same constructor as the baseline (``approximate``: ``"none"`` or ``"tanh"``).

    Forward: x ``[num_tokens, 2 * d]`` -> ``gelu(x[:, :d]) * x[:, d:]`` ``[num_tokens, d]``.
    """

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate).mul_(x[..., d:])
