"""L2 ``fused_moe`` baseline (vLLM ``FusedMoE``), per TP rank: Mixtral, Qwen3-MoE.

``forward(hidden_states, router_logits)``: softmax of the router logits in fp32, top-k
experts per token, renormalised to sum 1 when ``renormalize`` (vLLM ``fused_topk``;
Mixtral always, Qwen3-MoE when ``norm_topk_prob``), then for every expert hit:
``w2 @ silu_and_mul(w13 @ x)`` of its tokens, times the routing weight, added into the
output. The router GEMM (vLLM ``ReplicatedLinear`` ``gate``) stays outside, as in vLLM.
The loop, the fp32 routing weights and the accumulation into an output of the model
dtype in expert order are those of transformers ``MixtralExperts`` /
``Qwen3MoeExperts``, so the baseline equals ``MixtralSparseMoeBlock`` bit for bit and
``Qwen3MoeSparseMoeBlock`` up to Qwen's rounding of the routing weights to the model
dtype first.

TP: vLLM's ``FusedMoE`` without expert parallelism shards every expert's intermediate
dimension: ``w13_weight`` ``[E, 2 * I/tp, hidden]``, ``w2_weight`` ``[E, hidden, I/tp]``
with ``I = moe_intermediate_size`` (Qwen3-MoE) or ``intermediate_size`` (Mixtral). The
output is this rank's partial sum (the all-reduce is omitted, as in ``mlp``).

Traffic: minimum DRAM bytes = the weights of the experts the batch hits (expected number
under uniform routing, ``E * (1 - (1 - k/E)^N)``, rounded) + hidden states, router logits
and output once; FLOPs = ``N * k * (2 * hidden * 2 I/tp + 2 * (I/tp) * hidden + 5 I/tp)``
(the GEMMs of the k experts of every token, as vLLM's ``benchmark_moe`` counts them, plus
the activation).

Tolerance: class ``fused`` (bf16 atol 2e-2, rtol 1e-2; vLLM's fused-MoE tests use atol
2e-2): each expert's activation is rounded and reduced again by ``w2``, and up to k expert
outputs are summed in the model dtype, in an order a fused kernel may change.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kb_nano.operators.base import (
    DTYPES,
    TOLERANCES,
    NotApplicable,
    Operator,
    config_field,
    element_size,
    moe_not_covered,
    normal,
    shard,
)

# Architectures whose decoder MLPs are mixtures of experts (used when the expert fields of
# config.json are not at hand, e.g. `kernels --map`).
MOE_MODEL_TYPES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "phimoe", "olmoe")


def num_experts(facts: dict) -> int:
    """Routed experts of the model (0 for a dense model)."""
    return int(config_field(facts, "num_local_experts", "num_experts", "n_routed_experts", default=0) or 0)


def is_moe(facts: dict) -> bool:
    """True when the model's MLPs are mixtures of experts: read from its module tree
    (``facts['mlp_blocks']``, :func:`kb_nano.models.module_tree.mlp_blocks`) when the facts
    have it, else from the config's expert fields and model type."""
    if "mlp_blocks" in facts:
        return facts["mlp_blocks"]["moe"] is not None
    return num_experts(facts) > 0 or facts.get("model_type") in MOE_MODEL_TYPES


class FusedMoE(nn.Module):
    """Mixture-of-experts block of one TP rank with vLLM's ``FusedMoE`` signature.

    Args:
        num_experts: routed experts ``E``.
        top_k: experts per token (``num_experts_per_tok``).
        hidden_size: model hidden size.
        intermediate_size: one expert's (full, unsharded) intermediate size.
        params_dtype: dtype of the expert weights (torch dtype or its name; default float32).
        reduce_results: vLLM's all-reduce flag; the per-rank module never reduces.
        renormalize: rescale the top-k routing weights to sum 1.
        tp_size: TP degree (kb-nano addition).
        prefix: layer name (unused). activation: ``silu`` only (every vendored MoE model).
    Forward: hidden_states ``[N, hidden_size]``; router_logits ``[N, E]`` (the ``gate``
    output). Returns ``[N, hidden_size]`` in the hidden_states dtype.
    State dict: ``w13_weight`` ``[E, 2 * I/tp, hidden]`` (gate rows then up rows),
    ``w2_weight`` ``[E, hidden, I/tp]`` (vLLM's names and layouts).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        params_dtype: torch.dtype | str | None = None,
        reduce_results: bool = False,
        renormalize: bool = True,
        tp_size: int = 1,
        prefix: str = "",
        activation: str = "silu",
    ) -> None:
        super().__init__()
        if activation != "silu":
            raise ValueError(f"activation {activation!r} not supported; supported: silu")
        if intermediate_size % tp_size:
            raise ValueError(f"tp_size={tp_size} does not divide intermediate_size={intermediate_size}")
        dtype = DTYPES[params_dtype] if isinstance(params_dtype, str) else (params_dtype or torch.float32)
        shard_size = intermediate_size // tp_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.tp_size = tp_size
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * shard_size, hidden_size, dtype=dtype))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, shard_size, dtype=dtype))
        # nn.Linear's default init per expert (uniform +-1/sqrt(fan_in)): outputs of order 1.
        nn.init.uniform_(self.w13_weight, -(hidden_size**-0.5), hidden_size**-0.5)
        nn.init.uniform_(self.w2_weight, -(shard_size**-0.5), shard_size**-0.5)

    def select_experts(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights fp32 [N, k], topk_ids int64 [N, k])`` (vLLM ``fused_topk``)."""
        probs = torch.softmax(router_logits.float(), dim=-1)
        topk_weights, topk_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_weights, topk_ids

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.select_experts(router_logits)
        out = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(topk_ids, num_classes=self.num_experts).permute(2, 1, 0)  # [E, k, N]
        hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            top_k_pos, token_idx = torch.where(expert_mask[e])
            gate, up = F.linear(hidden_states[token_idx], self.w13_weight[e]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, self.w2_weight[e])
            h = h * topk_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, h.to(out.dtype))
        return out


def moe_intermediate_size(facts: dict) -> int:
    """One expert's intermediate size: ``moe_intermediate_size`` (Qwen-MoE) or
    ``intermediate_size`` (Mixtral)."""
    return int(config_field(facts, "moe_intermediate_size", default=facts["intermediate_size"]))


def _init_args(facts: dict, tp: int) -> dict:
    if moe_not_covered(facts):
        raise NotApplicable(moe_not_covered(facts))
    e = num_experts(facts)
    top_k = config_field(facts, "num_experts_per_tok")
    if not e or not top_k:
        raise NotApplicable("expert fields of config.json not available (num_experts, num_experts_per_tok)")
    if facts["hidden_act"] != "silu":
        raise NotApplicable(
            f"not covered: hidden_act {facts['hidden_act']!r} is not implemented by the baseline (silu)"
        )
    inter = moe_intermediate_size(facts)
    shard(inter, tp, "moe intermediate_size")
    return {
        "num_experts": e,
        "top_k": int(top_k),
        "hidden_size": facts["hidden_size"],
        "intermediate_size": inter,
        "params_dtype": facts["dtype"],
        "renormalize": bool(config_field(facts, "norm_topk_prob", default=True)),
        "tp_size": tp,
    }


def _inputs(args, facts, tp, num_tokens, dtype):
    return [
        normal("hidden_states", [num_tokens, args["hidden_size"]], dtype),
        normal("router_logits", [num_tokens, args["num_experts"]], dtype),
    ]


def _traffic(args, inputs, dtype):
    n, h = inputs[0]["shape"]
    es = element_size(inputs[0]["dtype"])
    e, k = args["num_experts"], args["top_k"]
    i = args["intermediate_size"] // args["tp_size"]
    experts_hit = max(1, round(e * (1 - (1 - k / e) ** n)))
    nbytes = experts_hit * 3 * h * i * element_size(args["params_dtype"]) + (2 * n * h + n * e) * es
    return nbytes, n * k * (2 * h * 2 * i + 2 * i * h + 5 * i)


OPERATORS = {
    "fused_moe": Operator(
        name="fused_moe",
        level=2,
        category="moe",
        baseline=FusedMoE,
        init_args=_init_args,
        inputs=_inputs,
        traffic=_traffic,
        used_in="layers.*.mlp.experts / block_sparse_moe.experts (after the router gate; MoE models)",
        applies_to=is_moe,
        reads_module_tree=True,
        tolerance=dict(TOLERANCES["fused"]),
    ),
}
