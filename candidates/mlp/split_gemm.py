"""mlp with the gate and up GEMMs run on the two halves of ``gate_up_proj.weight`` (no
2·I-wide intermediate to slice) and the activation done in place."""

import torch
import torch.nn.functional as F
from torch import nn


class SplitGemmMLP(nn.Module):
    """Same constructor, forward and state_dict (``gate_up_proj.weight``, ``down_proj.weight``)
    as kb_nano's LlamaMLP baseline.

    Forward: x ``[N, hidden]`` -> ``[N, hidden]`` (this rank's partial sum at tp > 1).
    """

    def __init__(
        self,
        hidden_size,
        intermediate_size,
        hidden_act,
        quant_config=None,
        bias=False,
        prefix="",
        reduce_results=True,
        tp_size=1,
    ) -> None:
        super().__init__()
        if bias or quant_config is not None:
            raise ValueError("bias / quantization not supported by this candidate")
        self.shard = intermediate_size // tp_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * self.shard, bias=False)
        self.down_proj = nn.Linear(self.shard, hidden_size, bias=False)
        self.gelu = hidden_act != "silu"
        self.approximate = "none" if hidden_act == "gelu" else "tanh"  # exact GELU, or Gemma's tanh form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.gate_up_proj.weight
        gate = F.linear(x, w[: self.shard])
        up = F.linear(x, w[self.shard :])
        act = F.gelu(gate, approximate=self.approximate) if self.gelu else F.silu(gate, inplace=True)
        return F.linear(act.mul_(up), self.down_proj.weight)
