"""fused_moe with tokens grouped by expert once (a stable argsort of the flattened top-k
ids, as vLLM's ``moe_align_block_size`` does for its Triton kernel) instead of a one-hot
mask and a ``torch.where`` per expert; each expert's GEMMs run on a contiguous slice, the
weighted outputs land in a ``[N, top_k, hidden]`` buffer and are summed in fp32 (vLLM's
``moe_sum``), then rounded once."""

import torch
import torch.nn.functional as F
from torch import nn


class SortedExpertsMoE(nn.Module):
    """Same constructor, forward and state_dict (``w13_weight``, ``w2_weight``) as kb_nano's
    FusedMoE baseline.

    Forward: hidden_states ``[N, hidden]``, router_logits ``[N, E]`` -> ``[N, hidden]``.
    """

    def __init__(
        self,
        num_experts,
        top_k,
        hidden_size,
        intermediate_size,
        params_dtype=None,
        reduce_results=False,
        renormalize=True,
        tp_size=1,
        prefix="",
        activation="silu",
    ):
        super().__init__()
        dtype = getattr(torch, params_dtype) if isinstance(params_dtype, str) else (params_dtype or torch.float32)
        shard = intermediate_size // tp_size
        self.num_experts, self.top_k, self.renormalize, self.shard = num_experts, top_k, renormalize, shard
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * shard, hidden_size, dtype=dtype))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, shard, dtype=dtype))

    def forward(self, hidden_states, router_logits):
        n, h = hidden_states.shape
        weights, ids = torch.softmax(router_logits.float(), dim=-1).topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
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
            gate, up = F.linear(x, self.w13_weight[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2_weight[e])
            out[rows] = y * weights.view(-1)[rows, None]
            start += count
        return out.view(n, self.top_k, h).sum(dim=1).to(hidden_states.dtype)
