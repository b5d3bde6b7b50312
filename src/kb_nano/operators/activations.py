"""Gated activations of the MLP: ``silu_and_mul`` (vLLM ``SiluAndMul``, SwiGLU: Llama, Qwen,
Mistral) and ``gelu_and_mul`` (vLLM ``GeluAndMul(approximate="tanh")``, GeGLU: Gemma)."""

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


# hidden_act values whose function is GELU with the tanh approximation
# (transformers ``ACT2FN``: ``gelu_pytorch_tanh`` = ``F.gelu(x, approximate="tanh")``).
GELU_TANH_ACTS = ("gelu_pytorch_tanh",)


class GeluAndMul(nn.Module):
    """``gelu(x[..., :d], approximate) * x[..., d:]`` with ``d = x.shape[-1] // 2`` (vLLM
    ``GeluAndMul.forward_native``; transformers ``GemmaMLP``/``Gemma2MLP``:
    ``act_fn(gate_proj(x)) * up_proj(x)`` with ``act_fn = gelu_pytorch_tanh``).

    Args: approximate: ``"none"`` (exact erf GELU) or ``"tanh"`` (Gemma's
    ``gelu_pytorch_tanh``), as in vLLM.
    Forward: x ``[num_tokens, 2 * d]`` (gate and up halves, ``d = intermediate_size / tp``).
    Returns ``[num_tokens, d]`` in x's dtype. No parameters.
    """

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"unknown approximate value {approximate!r}; expected 'none' or 'tanh'")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]


def _gelu_init_args(facts: dict, tp: int) -> dict:
    shard(facts["intermediate_size"], tp, "intermediate_size")
    return {"approximate": "tanh"}


def _gelu_traffic(args, inputs, dtype):
    n, two_d = inputs[0]["shape"]
    es = element_size(inputs[0]["dtype"])
    d = two_d // 2
    # read gate and up, write out. tanh-GELU 0.5*x*(1+tanh(c*(x+0.044715*x^3))):
    # ~8 flops + tanh (counted as 1) + the gating mul = 10 per output element.
    return 3 * n * d * es, 10 * n * d


OPERATORS = {
    "gelu_and_mul": Operator(
        name="gelu_and_mul",
        level=1,
        category="activation",
        baseline=GeluAndMul,
        init_args=_gelu_init_args,
        inputs=_inputs,
        traffic=_gelu_traffic,
        used_in="layers.*.mlp.act_fn (GeGLU, between gate_up_proj and down_proj)",
        applies_to=lambda facts: facts["hidden_act"] in GELU_TANH_ACTS,
        edge_cases=("tiny", "large"),
    ),
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
        edge_cases=("tiny", "large"),
    ),
}
