"""The parts of the ``fused_moe`` baseline (:mod:`kb_nano.operators.moe`) that differ between
MoE architectures: the routing (which experts a token goes to, with which weights) and the
shared experts some models add to every token.

- :func:`fused_topk`: softmax over the router logits, top-k, optional renormalisation
  (vLLM ``fused_topk``; Mixtral, Qwen3-MoE, gpt-oss); or the top-k logits' sigmoid
  (Llama-4).
- :func:`grouped_topk`: vLLM's ``grouped_topk`` (``fused_moe/router/grouped_topk_router.py``,
  the native form its ``GroupedTopk`` op and the CUDA ``ops.grouped_topk`` kernel compute;
  DeepSeek-V2/V3): scores (softmax or sigmoid), experts split into ``num_expert_group``
  groups, the ``topk_group`` best groups kept, the top-k experts of those, routing weights
  gathered from the scores, renormalised, scaled. With an ``e_score_correction_bias``
  (DeepSeek-V3's ``topk_method: noaux_tc``) the bias is added to the scores for the choice
  of groups (each group's score: the sum of its two best biased scores) and of experts
  only; the weights come from the unbiased scores.
- :func:`sparsemixer`: Phi-3.5-MoE's top-2 routing in eval mode (vLLM's
  ``phimoe_routing_function``; transformers ``sparsemixer`` with ``training=False``).
- :func:`swiglu_oai`: gpt-oss's experts' activation, the clamped SwiGLU on interleaved
  gate/up columns (vLLM ``SwigluOAIAndMul``, the ``swigluoai`` activation of its fused MoE;
  transformers ``GptOssExperts._apply_gate``).
- :class:`SharedExperts`: the always-on experts of one TP rank (vLLM ``DeepseekV2MLP`` with
  ``reduce_results=False``: ``MergedColumnParallelLinear`` gate/up, ``SiluAndMul``,
  ``RowParallelLinear`` down), whose partial sum vLLM's ``SharedFusedMoE`` adds to the
  routed experts' before the all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SCORING_FUNCS = ("softmax", "sigmoid")


def fused_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring_func: str = "softmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM ``fused_topk``: ``softmax(router_logits fp32)``, top-k, renormalised to sum 1
    when ``renormalize``; with ``scoring_func="sigmoid"`` the top-k of the fp32 logits with
    the sigmoid of each as its weight (vLLM's ``Llama4MoE.custom_routing_function``: the
    same experts as a top-k of the sigmoid scores, ties included). router_logits ``[N, E]``
    -> ``(weights fp32 [N, k], ids int64 [N, k])``. Raises ``ValueError`` for a scoring
    function other than :data:`SCORING_FUNCS`."""
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func {scoring_func!r} not supported; supported: {', '.join(SCORING_FUNCS)}")
    if scoring_func == "sigmoid":
        values, topk_ids = torch.topk(router_logits.float(), top_k, dim=-1)
        topk_weights = values.sigmoid()
    else:
        topk_weights, topk_ids = torch.topk(torch.softmax(router_logits.float(), dim=-1), top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    scoring_func: str = "softmax",
    routed_scaling_factor: float = 1.0,
    e_score_correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM ``grouped_topk`` on router_logits ``[N, E]`` (scores in fp32, as its CUDA kernel
    computes them): ``E`` experts in ``num_expert_group`` equal groups; a group's score is
    its best expert's score, or with ``e_score_correction_bias`` ``[E]`` the sum of its two
    best biased scores; the ``topk_group`` best groups are kept and the ``top_k`` best
    experts of those chosen (on biased scores when there is a bias). Weights: the chosen
    experts' unbiased scores, divided by their sum when ``renormalize``, times
    ``routed_scaling_factor``. Returns ``(weights fp32 [N, k], ids int64 [N, k])``.
    Raises ``ValueError`` for a scoring function other than :data:`SCORING_FUNCS` or groups
    that do not divide ``E``."""
    n, e = router_logits.shape
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func {scoring_func!r} not supported; supported: {', '.join(SCORING_FUNCS)}")
    if e % num_expert_group or not 0 < topk_group <= num_expert_group:
        raise ValueError(f"{e} experts cannot be split into {num_expert_group} groups keeping {topk_group}")
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring_func == "softmax" else logits.sigmoid()
    if e_score_correction_bias is not None:
        choice = scores + e_score_correction_bias.float()
        group_scores = choice.view(n, num_expert_group, -1).topk(2, dim=-1).values.sum(dim=-1)
    else:
        choice = scores
        group_scores = choice.view(n, num_expert_group, -1).amax(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    expert_mask = group_mask.repeat_interleave(e // num_expert_group, dim=1)
    topk_ids = torch.topk(choice.masked_fill(~expert_mask, float("-inf")), k=top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights * routed_scaling_factor, topk_ids


def sparsemixer(router_logits: torch.Tensor, jitter_eps: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-3.5-MoE's top-2 routing in eval mode (vLLM ``phimoe_routing_function``;
    transformers ``sparsemixer(training=False)``), computed in the logits' dtype as both do.
    First expert: the row's maximum ``m`` (``torch.max``: a tie goes to the lowest index);
    its weight is its softmax over the experts whose logit ``s`` is within
    ``(m - s) / max(|s|, m) <= 2 * jitter_eps`` of it (a ``0 / 0`` counts as within). Second
    expert: the same on the row with the first expert's logit set to ``-inf`` (the threshold
    is the new maximum; the denominator still ``max(|s|, threshold)`` of the original
    logits). The weights are not renormalised and need not sum to 1. router_logits
    ``[N, E]`` (``E`` >= 2) -> ``(weights fp32 [N, 2], ids int64 [N, 2])``."""
    scores = router_logits
    weights, ids = [], []
    for step in range(2):
        if step:  # the first expert out of the choice
            scores = torch.scatter(router_logits, -1, ids[0], float("-inf"))
        threshold, best = scores.max(dim=-1, keepdim=True)
        factor = router_logits.abs().clamp(min=threshold)
        far = ((threshold - router_logits) / factor) > (2 * jitter_eps)
        gates = torch.softmax(scores.masked_fill(far, float("-inf")), dim=-1)
        weights.append(gates.gather(dim=-1, index=best))
        ids.append(best)
    return torch.cat(weights, dim=-1).float(), torch.cat(ids, dim=-1)


def swiglu_oai(gate_up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU on ``gate_up`` ``[..., 2 * I]`` whose gate and up columns
    alternate (gate ``[..., 0::2]``, up ``[..., 1::2]``): gate clamped to at most ``limit``,
    up to ``[-limit, limit]``, ``(up + 1) * gate * sigmoid(alpha * gate)`` -> ``[..., I]`` in
    the input dtype (vLLM ``SwigluOAIAndMul.forward_native``: alpha 1.702, limit 7.0)."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class SharedExperts(nn.Module):
    """The shared experts of one TP rank (vLLM ``DeepseekV2MLP``, ``reduce_results=False``):
    ``down_proj(silu(gate) * up)`` with ``gate_up_proj.weight`` ``[2 * I/tp, hidden]`` (gate
    rows then up rows) and ``down_proj.weight`` ``[hidden, I/tp]``, ``I`` the full width
    (``moe_intermediate_size * n_shared_experts``). Forward: x ``[N, hidden]`` -> this rank's
    partial sum ``[N, hidden]``. Raises ``ValueError`` when ``tp_size`` does not divide ``I``."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp_size: int = 1, dtype=None) -> None:
        super().__init__()
        if intermediate_size % tp_size:
            raise ValueError(f"tp_size={tp_size} does not divide the shared experts' width {intermediate_size}")
        width = intermediate_size // tp_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * width, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(width, hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj.weight).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj.weight)
