"""``silu_and_mul`` baseline (vLLM ``SiluAndMul``), the gated activation of SwiGLU MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kb_nano.operators.base import Operator, element_size, normal, shard


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2`` (vLLM ``forward_native``;
    transformers ``LlamaMLP``: ``act_fn(gate_proj(x)) * up_proj(x)``).

    Forward: x ``[num_tokens, 2 * d]`` (gate and up halves, TP-sharded ``d =
    intermediate_size / tp``). Returns ``[num_tokens, d]`` in x's dtype. No parameters.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


def _init_args(facts: dict, tp: int) -> dict:
    shard(facts["intermediate_size"], tp, "intermediate_size")
    return {}


def _inputs(args, facts, tp, num_tokens, dtype):
    d = shard(facts["intermediate_size"], tp, "intermediate_size")
    return [normal("x", [num_tokens, 2 * d], dtype)]


def _traffic(args, inputs, dtype):
    n, two_d = inputs[0]["shape"]
    es = element_size(inputs[0]["dtype"])
    d = two_d // 2
    # read gate and up, write out; silu ~ 4 flops (exp, add, div, mul) + 1 mul.
    return 3 * n * d * es, 5 * n * d


OPERATORS = {
    "silu_and_mul": Operator(
        name="silu_and_mul",
        level=1,
        category="activation",
        baseline=SiluAndMul,
        init_args=_init_args,
        inputs=_inputs,
        traffic=_traffic,
        used_in="layers.*.mlp.act_fn (between gate_up_proj and down_proj)",
        applies_to=lambda facts: facts["hidden_act"] == "silu",
    ),
}
