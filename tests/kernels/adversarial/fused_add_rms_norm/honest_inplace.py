"""Control: fused_add_rms_norm the way vLLM's kernel works: residual += x and x =
norm(residual) written in place, returning views of the inputs. The operator's contract
(``mutable_inputs``) allows it. Must pass."""

import torch
import torch.nn.functional as F
from torch import nn

EXPECTED = "passed"


class HonestInplace(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x, residual=None):
        s = x.float() + residual.float()
        residual.copy_(s)
        x.copy_(F.rms_norm(s, (self.hidden_size,), None, self.variance_epsilon).to(x.dtype) * self.weight)
        return x, residual
