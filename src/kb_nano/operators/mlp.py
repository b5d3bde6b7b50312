"""L2 ``mlp`` baseline (vLLM ``LlamaMLP`` / ``GemmaMLP``), per TP rank.

``down_proj(act_and_mul(gate_up_proj(x)))``: ``gate_up_proj`` is vLLM's
``MergedColumnParallelLinear`` (gate rows then up rows, each ``intermediate_size / tp``),
``down_proj`` the ``RowParallelLinear`` (``[hidden, intermediate_size / tp]``), the
activation ``SiluAndMul`` (SwiGLU: Llama, Qwen, Mistral) or ``GeluAndMul("tanh")`` (GeGLU:
Gemma). At TP=k the output is this rank's partial sum: vLLM's all-reduce after
``down_proj`` (``reduce_results``) is not part of the measured compute, as ``embedding``
omits its all-reduce. The reference is transformers ``LlamaMLP``:
``down_proj(act_fn(gate_proj(x)) * up_proj(x))``.

Dense architectures only: in Mixtral and Qwen3-MoE every layer's MLP is a ``fused_moe``.

Traffic: minimum DRAM bytes = the three weight matrices once + x in + output out (a
fused kernel keeps the intermediate on chip); FLOPs = ``2 * N * hidden * (2 * I/tp)``
(gate_up GEMM) + ``2 * N * (I/tp) * hidden`` (down GEMM) + 5 per activation element
(the usual 2·M·N·K GEMM count).

Tolerance: class ``fused`` (bf16 atol 6e-2 x the output's rms, rtol 1.6e-2): the activation is rounded to the
model dtype and then reduced over ``I/tp`` terms again by the down projection, so a kernel
that keeps it in fp32 differs from the baseline by a few output ulps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kb_nano.operators.activations import GELU_EXACT_ACTS, GELU_TANH_ACTS, GeluAndMul, SiluAndMul
from kb_nano.operators.base import (
    TOLERANCES,
    NotApplicable,
    Operator,
    dense_mlp,
    element_size,
    intermediate_size,
    normal,
    shard,
)
from kb_nano.operators.moe import is_moe

SUPPORTED_ACTS = ("silu", *GELU_TANH_ACTS, *GELU_EXACT_ACTS)


class LlamaMLP(nn.Module):
    """Gated MLP of one TP rank with vLLM's ``LlamaMLP`` signature.

    Args:
        hidden_size, intermediate_size: the model's (full, unsharded) sizes.
        hidden_act: ``silu`` (``SiluAndMul``), ``gelu_pytorch_tanh`` (``GeluAndMul("tanh")``,
            as vLLM ``GemmaMLP``) or ``gelu`` (``GeluAndMul("none")``, the exact GELU).
        quant_config, prefix: vLLM signature; must be None / are ignored.
        bias: linear biases (Llama's ``mlp_bias``; none in the vendored models): this rank's
            ``gate_up_proj`` bias shard, and the whole ``down_proj`` bias, which vLLM's
            ``RowParallelLinear`` adds on rank 0 only (the rank this module stands for).
        reduce_results: vLLM's all-reduce flag; the per-rank module never reduces.
        tp_size: TP degree (kb-nano addition: vLLM reads it from its distributed state).
    Forward: x ``[num_tokens, hidden_size]``. Returns ``[num_tokens, hidden_size]`` (this
    rank's partial sum at tp > 1).
    State dict: ``gate_up_proj.weight`` ``[2 * intermediate_size / tp, hidden_size]``,
    ``down_proj.weight`` ``[hidden_size, intermediate_size / tp]`` (vLLM's names and layouts).
    Raises ``ValueError`` for an unsupported activation or a TP that does not divide.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        quant_config=None,
        bias: bool = False,
        prefix: str = "",
        reduce_results: bool = True,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        if hidden_act not in SUPPORTED_ACTS:
            raise ValueError(f"unsupported activation {hidden_act!r}; supported: {SUPPORTED_ACTS}")
        if quant_config is not None:
            raise ValueError("quantized MLP is not supported by the baseline")
        if intermediate_size % tp_size:
            raise ValueError(f"tp_size={tp_size} does not divide intermediate_size={intermediate_size}")
        shard_size = intermediate_size // tp_size
        self.hidden_act = hidden_act
        self.tp_size = tp_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * shard_size, bias=bias)
        self.down_proj = nn.Linear(shard_size, hidden_size, bias=bias)
        if hidden_act == "silu":
            self.act_fn = SiluAndMul()
        else:
            self.act_fn = GeluAndMul(approximate="none" if hidden_act in GELU_EXACT_ACTS else "tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
        x = self.act_fn(gate_up)
        return F.linear(x, self.down_proj.weight, self.down_proj.bias)


# activation of the module tree's MLP (kb_nano.models.module_tree.activation_name) -> hidden_act
TREE_ACTS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}


def _init_args(facts: dict, tp: int) -> dict:
    dense = dense_mlp(facts)
    act = facts["hidden_act"]
    if dense is None:
        width = intermediate_size(facts)
    else:  # the model's own MLP module: its width and activation
        if not dense.get("gated", True):
            raise NotApplicable(f"not covered: {dense['class']} is not gated (down(act(up(x))), no gate_proj)")
        if dense.get("scaled"):
            raise NotApplicable(f"not covered: {dense['class']} scales inside the block ({', '.join(dense['scaled'])})")
        if dense["act"] not in TREE_ACTS or dense["intermediate_size"] is None:
            raise NotApplicable(f"not covered: {dense['class']} (activation {dense['act_class']})")
        width, act = dense["intermediate_size"], TREE_ACTS[dense["act"]]
    if act not in SUPPORTED_ACTS:
        raise NotApplicable(f"not covered: hidden_act {act!r} is not implemented by the baseline ({SUPPORTED_ACTS})")
    shard(width, tp, "intermediate_size")
    return {
        "hidden_size": facts["hidden_size"],
        "intermediate_size": width,
        "hidden_act": act,
        "tp_size": tp,
        **({"bias": True} if dense is not None and dense.get("bias") else {}),
    }


def _uses_mlp(facts: dict) -> bool:
    """A decoder layer with a dense MLP of its own: any, from the module tree (DeepSeek's
    first dense layers count), else a model that is not MoE."""
    if "mlp_blocks" in facts:
        return dense_mlp(facts) is not None
    return not is_moe(facts)


def _inputs(args, facts, tp, num_tokens, dtype):
    return [normal("x", [num_tokens, args["hidden_size"]], dtype)]


def _traffic(args, inputs, dtype):
    n, h = inputs[0]["shape"]
    es = element_size(inputs[0]["dtype"])
    i = args["intermediate_size"] // args["tp_size"]
    return 3 * h * i * es + 2 * n * h * es, 2 * n * h * 2 * i + 2 * n * i * h + 5 * n * i


OPERATORS = {
    "mlp": Operator(
        name="mlp",
        level=2,
        category="mlp",
        baseline=LlamaMLP,
        init_args=_init_args,
        inputs=_inputs,
        traffic=_traffic,
        used_in="layers.*.mlp (gate_up_proj -> act_fn -> down_proj; dense models)",
        applies_to=_uses_mlp,
        reads_module_tree=True,
        tolerance=dict(TOLERANCES["fused"]),
        semantics=lambda facts: "bias" if (dense_mlp(facts) or {}).get("bias") else "",
    ),
}
