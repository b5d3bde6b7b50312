"""swigluoai_and_mul (gpt-oss's clamped SwiGLU) with one output allocation: the clamped gate's
sigmoid is computed into a new tensor and everything after it happens in place."""

import torch
from torch import nn


class InplaceSwigluOAIAndMul(nn.Module):
    """Same constructor as the baseline (``alpha``, ``limit``).

    Forward: x ``[rows, 2 * d]`` with gate and up columns alternating -> ``(clamp(up, -limit,
    limit) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=limit)``, ``[rows, d]``
    in x's dtype.
    """

    def __init__(self, alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__()
        self.alpha, self.limit = float(alpha), float(limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x[..., ::2], x[..., 1::2]
        g = gate.clamp(max=self.limit)  # the one new tensor besides the output
        out = torch.sigmoid(g * self.alpha)
        out.mul_(g)
        g.copy_(up).clamp_(min=-self.limit, max=self.limit).add_(1.0)
        return out.mul_(g)
