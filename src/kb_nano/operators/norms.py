"""RMSNorm baselines: ``rms_norm`` and ``fused_add_rms_norm`` (vLLM ``RMSNorm``).

Semantics follow vLLM ``RMSNorm.forward_native`` and the transformers ``LlamaRMSNorm``:
compute in float32, ``x * rsqrt(mean(x^2) + eps)``, cast back to the input dtype, then
multiply by ``weight`` in that dtype. With ``residual`` the sum ``x + residual`` is
normalised and also returned as the new residual (in the input dtype).
"""

from __future__ import annotations

import torch
from torch import nn

from kb_nano.operators.base import Operator, element_size, normal


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with vLLM's signature.

    Args:
        hidden_size: size of the normalised (last) dimension.
        eps: ``rms_norm_eps`` of the model config.
    Forward:
        x: ``[num_tokens, hidden_size]``, bf16/fp16/fp32.
        residual: optional ``[num_tokens, hidden_size]`` same dtype.
    Returns:
        ``[num_tokens, hidden_size]`` in x's dtype, or ``(out, new_residual)`` with residual.
    State dict: ``weight`` ``[hidden_size]`` (initialised to ones as in vLLM).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        orig_dtype = x.dtype
        x = x.to(torch.float32)
        if residual is not None:
            x = x + residual.to(torch.float32)
            residual = x.to(orig_dtype)
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        x = x.to(orig_dtype) * self.weight
        return x if residual is None else (x, residual)


def _init_args(facts: dict, tp: int) -> dict:
    # The hidden dimension is replicated across TP ranks: same shape at every TP.
    return {"hidden_size": facts["hidden_size"], "eps": facts["rms_norm_eps"]}


def _rms_inputs(args, facts, tp, num_tokens, dtype):
    return [normal("x", [num_tokens, args["hidden_size"]], dtype)]


def _fused_inputs(args, facts, tp, num_tokens, dtype):
    h = args["hidden_size"]
    return [normal("x", [num_tokens, h], dtype), normal("residual", [num_tokens, h], dtype)]


def _rms_traffic(args, inputs, dtype):
    (x,) = inputs
    n, h = x["shape"]
    es = element_size(x["dtype"])
    return 2 * n * h * es + h * es, 4 * n * h


def _fused_traffic(args, inputs, dtype):
    n, h = inputs[0]["shape"]
    es = element_size(inputs[0]["dtype"])
    return 4 * n * h * es + h * es, 5 * n * h


OPERATORS = {
    "rms_norm": Operator(
        name="rms_norm",
        level=1,
        category="norm",
        baseline=RMSNorm,
        init_args=_init_args,
        inputs=_rms_inputs,
        traffic=_rms_traffic,
        used_in="model.norm (final norm); input_layernorm of layer 0",
    ),
    "fused_add_rms_norm": Operator(
        name="fused_add_rms_norm",
        level=1,
        category="norm",
        baseline=RMSNorm,
        init_args=_init_args,
        inputs=_fused_inputs,
        traffic=_fused_traffic,
        used_in="layers.*.input_layernorm (layers >= 1), layers.*.post_attention_layernorm",
    ),
}
