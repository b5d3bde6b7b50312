"""Shared pieces of the adversarial rms_norm candidates (a helper module: names starting
with ``_`` are not candidates)."""

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The correct result, as the baseline computes it: x ``[num_tokens, hidden]``."""
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight


class Base(nn.Module):
    """The baseline's constructor and state_dict (``weight``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
