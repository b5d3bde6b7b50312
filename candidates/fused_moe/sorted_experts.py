"""fused_moe with tokens grouped by expert once (a stable argsort of the flattened top-k
ids, as vLLM's ``moe_align_block_size`` does for its Triton kernel) instead of a one-hot
mask and a ``torch.where`` per expert; each expert's GEMMs run on a contiguous slice, the
weighted outputs land in a ``[N, top_k, hidden]`` buffer and are summed in fp32 (vLLM's
``moe_sum``), then rounded once.

DeepSeek-V3 (``deepseek_v3`` semantics): the routing weights are scaled by
``routed_scaling_factor`` inside the fp32 sum (as vLLM's ROCm AITER path and transformers do,
not on the rounded output), the group mask is built by sorting group scores once, and the
shared experts' output is added to the fp32 sum before the one rounding.

gpt-oss (``gpt_oss`` semantics): each expert's biases are added in its GEMMs and the clamped
SwiGLU runs on the interleaved gate/up columns; routing is the same renormalised softmax
top-k (equal to a softmax over the top-k logits).

Llama-4 (``llama4`` semantics): the top-1 logit's sigmoid scales the rows of the expert's
input (rounded to the model dtype) instead of its output; the shared expert as DeepSeek's.

Phi-3.5-MoE (``phimoe`` semantics): sparsemixer's two picks in the logits' dtype, the
first expert's logit replaced by ``-inf`` for the second (ties to the lowest index, as
``torch.max``); each weight a softmax over the logits within ``2 * jitter_eps`` (relative)
of that pick, not renormalised."""

import torch
import torch.nn.functional as F
from torch import nn


class SortedExpertsMoE(nn.Module):
    """Same constructor, forward and state_dict (``w13_weight``, ``w2_weight``; DeepSeek-V3:
    ``e_score_correction_bias``, ``shared_experts.gate_up_proj.weight``,
    ``shared_experts.down_proj.weight``; gpt-oss: ``w13_bias``, ``w2_bias``) as kb_nano's
    FusedMoE baseline.

    Forward: hidden_states ``[N, hidden]``, router_logits ``[N, E]`` -> ``[N, hidden]``.
    """

    supported_semantics = ("deepseek_v3", "gpt_oss", "llama4", "phimoe")

    def __init__(
        self,
        num_experts,
        top_k,
        hidden_size,
        intermediate_size,
        params_dtype=None,
        reduce_results=False,
        renormalize=True,
        use_grouped_topk=False,
        num_expert_group=None,
        topk_group=None,
        scoring_func="softmax",
        routed_scaling_factor=1.0,
        e_score_correction_bias=False,
        shared_experts_intermediate_size=0,
        apply_router_weight_on_input=False,
        custom_routing_function=None,
        jitter_eps=0.01,
        has_bias=False,
        tp_size=1,
        prefix="",
        activation="silu",
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
    ):
        super().__init__()
        dtype = getattr(torch, params_dtype) if isinstance(params_dtype, str) else (params_dtype or torch.float32)
        shard = intermediate_size // tp_size
        self.num_experts, self.top_k, self.renormalize, self.shard = num_experts, top_k, renormalize, shard
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * shard, hidden_size, dtype=dtype))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, shard, dtype=dtype))
        self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * shard, dtype=dtype)) if has_bias else None
        self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype)) if has_bias else None
        if activation not in ("silu", "swigluoai"):
            raise ValueError(f"activation {activation!r} not implemented")
        self.swiglu = (swiglu_alpha, swiglu_limit) if activation == "swigluoai" else None
        if use_grouped_topk and scoring_func != "sigmoid":
            raise ValueError(f"grouped top-k with scoring_func {scoring_func!r} not implemented")
        if scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func {scoring_func!r} not implemented")
        if custom_routing_function not in (None, "sparsemixer") or (custom_routing_function and top_k != 2):
            raise ValueError(f"custom_routing_function {custom_routing_function!r} with top_k={top_k} not implemented")
        self.sparsemixer = float(jitter_eps) if custom_routing_function else None
        self.groups = (num_expert_group, topk_group) if use_grouped_topk else None
        self.sigmoid_topk = scoring_func == "sigmoid" and not use_grouped_topk
        self.weight_on_input = apply_router_weight_on_input
        self.scale = float(routed_scaling_factor)
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(num_experts, dtype=dtype)) if e_score_correction_bias else None
        )
        self.shared_experts = None
        if shared_experts_intermediate_size:
            width = shared_experts_intermediate_size // tp_size
            self.shared_experts = nn.Module()
            self.shared_experts.gate_up_proj = nn.Linear(hidden_size, 2 * width, bias=False, dtype=dtype)
            self.shared_experts.down_proj = nn.Linear(width, hidden_size, bias=False, dtype=dtype)

    def route(self, router_logits):
        """(weights fp32 [N, k], ids [N, k])."""
        if self.sparsemixer is not None:
            return self.sparsemixer_route(router_logits, self.sparsemixer)
        if self.sigmoid_topk:
            weights, ids = router_logits.float().topk(self.top_k, dim=-1)
            weights = weights.sigmoid()
        elif self.groups is None:
            weights, ids = torch.softmax(router_logits.float(), dim=-1).topk(self.top_k, dim=-1)
        else:
            n_group, keep = self.groups
            scores = router_logits.float().sigmoid()
            biased = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias.float()
            grouped = biased.view(len(scores), n_group, -1)
            best = grouped.topk(2, dim=-1).values.sum(-1)
            if self.e_score_correction_bias is None:
                best = grouped.amax(-1)
            rank = best.argsort(dim=-1, descending=True).argsort(dim=-1)  # rank of each group
            masked = grouped.masked_fill((rank >= keep)[..., None], float("-inf")).flatten(1)
            ids = masked.topk(self.top_k, dim=-1).indices
            weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.scale, ids

    @staticmethod
    def sparsemixer_route(logits, eps):
        """Phi-3.5-MoE's two picks: (weights fp32 [N, 2], ids [N, 2])."""
        magnitude = logits.abs()
        picks, gates, scores = [], [], logits
        for _ in range(2):
            top, pick = scores.max(dim=-1, keepdim=True)
            outside = (top - logits) / magnitude.clamp(min=top) > 2 * eps
            gates.append(torch.softmax(scores.masked_fill(outside, float("-inf")), dim=-1).gather(-1, pick))
            picks.append(pick)
            scores = scores.scatter(-1, pick, float("-inf"))
        return torch.cat(gates, dim=-1).float(), torch.cat(picks, dim=-1)

    def activation(self, gate_up):
        """SiLU-and-mul on the gate and up halves, or gpt-oss's clamped SwiGLU on
        interleaved columns."""
        if self.swiglu is None:
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate) * up
        alpha, limit = self.swiglu
        gate = gate_up[..., ::2].clamp(max=limit)
        up = gate_up[..., 1::2].clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(alpha * gate)

    def forward(self, hidden_states, router_logits):
        n, h = hidden_states.shape
        weights, ids = self.route(router_logits)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        out = torch.empty(n * self.top_k, h, dtype=torch.float32, device=hidden_states.device)
        start = 0
        for e, count in enumerate(counts):
            if not count:
                continue
            rows = order[start : start + count]
            x = hidden_states[tokens[start : start + count]]
            if self.weight_on_input:
                x = x * weights.view(-1)[rows, None].to(x.dtype)
            y = F.linear(x, self.w13_weight[e], None if self.w13_bias is None else self.w13_bias[e])
            y = self.activation(y)
            y = F.linear(y, self.w2_weight[e], None if self.w2_bias is None else self.w2_bias[e])
            out[rows] = y.float() if self.weight_on_input else y * weights.view(-1)[rows, None]
            start += count
        total = out.view(n, self.top_k, h).sum(dim=1)
        if self.shared_experts is not None:
            gate, up = F.linear(hidden_states, self.shared_experts.gate_up_proj.weight).chunk(2, dim=-1)
            total += F.linear(F.silu(gate) * up, self.shared_experts.down_proj.weight).float()
        return total.to(hidden_states.dtype)
