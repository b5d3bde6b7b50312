"""Attention that never materialises repeated KV heads or a concatenated cache: queries of
one KV group are stacked as the rows of one GEMM against that group's keys (GQA
grouping, as FlashAttention / vLLM's decode kernels do), and in decode the cached and the
new key are scored separately and joined only in the (small) score tensor.

Same math as the eager baseline (bf16 scores, fp32 scores under a soft-cap, fp32 softmax,
probabilities rounded to the input dtype); the output of decode is the sum of two GEMM
results, so it may differ from the baseline by an output ulp. Supports sliding-window
layers (``per_layer_sliding_window``), Llama-4's chunked layers (``attention_chunk_size``:
a query sees the earlier keys of its own chunk) and attention sinks (``sinks``: each head's sink
logit joins its score rows as one more column of the grouped score tensor, the softmax
taken in the scores' dtype as the baseline does, and the column dropped), both declared
in ``supported_semantics``.
"""

import torch
from torch import nn


class GroupedQueryAttention(nn.Module):
    """Same constructor and forward as kb_nano's Attention baseline.

    Forward: query ``[N, H*D]``, key/value ``[N, KV*D]``, optional key_cache/value_cache
    ``[N, C, KV, D]`` -> ``[N, H*D]``.
    """

    supported_semantics = ("sliding_window", "chunked_attention", "sinks")

    def __init__(
        self,
        num_heads,
        head_size,
        scale,
        num_kv_heads=None,
        logits_soft_cap=None,
        per_layer_sliding_window=None,
        prefix="",
        sinks=False,
        attention_chunk_size=None,
    ):
        super().__init__()
        self.window = per_layer_sliding_window
        self.chunk = attention_chunk_size
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.group = self.num_heads // self.num_kv_heads
        self.logits_soft_cap = logits_soft_cap
        # per-head sink logits [H] (head kv * group + j), loaded from the baseline
        self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False) if sinks else None

    def _logits(self, t):
        # soft-capped logits in float32, as the baseline (and vLLM's soft-capping kernels) has them
        return t.float() if self.logits_soft_cap else t

    def _probs(self, scores, mask=None, sinks=None):
        scores = scores * self.scale
        if self.logits_soft_cap:
            scores = torch.tanh(scores / self.logits_soft_cap) * self.logits_soft_cap
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        if sinks is None:
            return torch.softmax(scores, dim=-1, dtype=torch.float32)
        # sinks: one logit per score row, broadcast to [..., rows, 1]
        combined = torch.cat((scores, sinks.expand(*scores.shape[:-1], 1)), dim=-1)
        combined = combined - combined.amax(dim=-1, keepdim=True)
        return torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]

    def forward(self, query, key, value, key_cache=None, value_cache=None):
        n, kv, g, d = query.shape[0], self.num_kv_heads, self.group, self.head_size
        if key_cache is None:
            # prefill: [kv, g * n, d] rows against [kv, d, n] keys of the same group
            q = query.view(n, kv, g, d).permute(1, 2, 0, 3).reshape(kv, g * n, d)
            k = key.view(n, kv, d).permute(1, 2, 0)
            v = value.view(n, kv, d).transpose(0, 1)
            pos = torch.arange(n, device=query.device)
            ahead = pos[:, None] - pos[None, :]
            mask = (ahead < 0) | (ahead >= self.window) if self.window else ahead < 0
            if self.chunk:
                mask = mask | (pos[:, None] // self.chunk != pos[None, :] // self.chunk)
            mask = mask.repeat(g, 1)
            # row r = j * n + i of group kv is head kv * g + j
            sinks = (
                None if self.sinks is None else self.sinks.view(kv, g, 1, 1).expand(kv, g, n, 1).reshape(kv, g * n, 1)
            )
            p = self._probs(torch.bmm(self._logits(q), self._logits(k)), mask, sinks).to(query.dtype)
            out = torch.bmm(p, v)  # [kv, g * n, d]
            return out.view(kv, g, n, d).permute(2, 0, 1, 3).reshape(n, self.num_heads * d)
        # decode: [n, kv, g, d] against the cache [n, kv, d, C] and the new key [n, kv, d, 1]
        c = key_cache.shape[1]
        q = self._logits(query.view(n, kv, g, d))
        s_cache = torch.matmul(q, self._logits(key_cache.permute(0, 2, 3, 1)))
        s_new = torch.matmul(q, self._logits(key.view(n, kv, d, 1)))
        mask = None
        if self.window and c + 1 > self.window:  # the new token at position c sees keys > c - window
            mask = c - torch.arange(c + 1, device=query.device) >= self.window
        if self.chunk and c >= self.chunk:  # ... and keys from the start of its chunk on
            earlier = torch.arange(c + 1, device=query.device) < c // self.chunk * self.chunk
            mask = earlier if mask is None else mask | earlier
        sinks = None if self.sinks is None else self.sinks.view(1, kv, g, 1)
        p = self._probs(torch.cat((s_cache, s_new), dim=-1), mask, sinks).to(query.dtype)
        out = torch.matmul(p[..., :c], value_cache.transpose(1, 2)) + p[..., c:] * value.view(n, kv, 1, d)
        return out.reshape(n, self.num_heads * d)
