"""silu_and_mul writing into the activation of the gate half: one output allocation,
``silu`` computed once, the multiply done in place."""

import torch
import torch.nn.functional as F
from torch import nn


class InplaceSiluAndMul(nn.Module):
    """Forward: x ``[num_tokens, 2 * d]`` -> ``silu(x[:, :d]) * x[:, d:]`` ``[num_tokens, d]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]).mul_(x[..., d:])
