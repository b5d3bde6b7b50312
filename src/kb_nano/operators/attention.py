"""L2 ``attention`` baseline (vLLM ``Attention``), per TP rank: causal prefill and decode.

Semantics are transformers' ``eager_attention_forward`` (the reference of every vendored
architecture): ``softmax(q @ k^T * scale [+ soft-cap] [+ causal mask], fp32) -> model dtype
@ v`` with the KV heads repeated for GQA (``repeat_kv``). As in vLLM, RoPE (and Qwen3's
QK-norm) is applied *outside*: ``LlamaAttention.forward`` calls ``self.rotary_emb`` and then
``self.attn(q, k, v)``, so the inputs here are q/k after rotary.

Two scenario kinds (the ``variants`` of the operator):

- prefill (``attention__{model}__tp{k}__n{N}``): one sequence of ``N = num_tokens``
  tokens, no KV cache; token i attends to tokens 0..i.
- decode (``...__n{N}__ctx{C}``): ``N`` sequences decoding one token each against a
  KV cache of ``C = context_len`` earlier tokens per sequence; the new token attends to
  its ``C`` cached tokens and itself. The cache is contiguous, one row block per
  sequence, ``[N, C, num_kv_heads, head_size]`` (flash-attn ``flash_attn_with_kvcache``
  layout; vLLM's paged cache adds a block table, which kb-nano does not model).

Layer kinds (:func:`~kb_nano.operators.attention_scenarios.layer_kinds`): each decoder layer's attention module of the model, built
on the meta device (:func:`kb_nano.models.attention_tree.attention_layers`), gives its softmax
scale, sliding window and logit soft-cap; a model whose layers differ (Gemma-2 and
Gemma-3: sliding-window and global layers) gets scenarios per kind, with the kind in the id
(``__sliding4096``, ``__full``). A sliding layer's window is the constructor's
``per_layer_sliding_window`` (vLLM ``Attention``): the query at position i sees keys
i - W + 1 .. i (transformers' sliding-window mask); those scenarios have the
``sliding_window`` semantics, which a candidate declares in ``supported_semantics``, and
a decode scenario twice as long as the window is added. A layer with attention sinks
(gpt-oss: a learned logit per head that joins each softmax row as an extra key and is
dropped after it) passes ``sinks=True``: the baseline then holds the per-rank sink logits
as its parameter ``sinks`` ``[num_heads]`` and those scenarios have the ``sinks``
semantics (``sliding_window+sinks`` on a sliding layer). Llama-4's layers with rotation
are ``chunked_attention`` layers (``__chunked8192``): the query at position i sees the
earlier keys of its chunk, positions floor(i / C) * C .. i (the constructor's
``attention_chunk_size``, vLLM ``ChunkedLocalAttention``); decode scenarios of C and 1.5 C
are added (:func:`~kb_nano.operators.attention_scenarios.variants`). Its layers without rotation are ``full`` layers whose queries vLLM's
``Llama4Attention.forward`` scales by a factor of the position in torch before calling
``Attention`` (``attn_temperature_tuning``): kb-nano measures the op, not that scaling.
An attention module with other parts kb-nano does not measure (an MLA class other than
DeepSeek-V3's) makes the operator ``n/a: not covered: ...`` for the model.
Multi-head latent attention (DeepSeek-V3) is a layer kind with the ``mla`` semantics (ids
end in ``__mla``), computed as vLLM's MLA backends do: :mod:`kb_nano.operators.mla`.

Inputs: q and k are drawn from N(0, s^2) with s^2 = cap / (sqrt(head_size) * scale) when
the layer soft-caps its logits, so the logits' spread is the cap and ``tanh`` binds (on
N(0, 1) inputs ``cap * tanh(x / cap)`` would be the identity and a kernel without the cap
would pass); with sinks, s^2 = 1 / (sqrt(head_size) * scale) (logits of variance 1, N(0,
1) for gpt-oss) and the sink logits spread over the heads (:data:`SINK_MAX`) so that some
heads' sinks take a real share of every row's probability mass; N(0, 1) otherwise. With
a soft-cap the baseline computes the logits in float32, as vLLM's soft-capping kernels
(FlashAttention, FlashInfer) accumulate them: logits of the cap's size rounded to bf16
before the ``tanh`` move by ~0.1, and a float32 kernel then differed from a bf16-logit
one by up to 0.3 beyond the tolerance (prefill of 64 tokens at Gemma-2's shapes, CPU).

Traffic (:func:`~kb_nano.operators.attention_scenarios.traffic`): minimum DRAM bytes = q, k, v, output (+ the two caches in decode,
+ the sinks) read/written once; FLOPs = the two GEMMs ``q @ k^T`` and ``p @ v``, 2 *
head_size FLOPs each per (query head, query token, visible key) pair — the standard count
of the FlashAttention papers (causal prefill: N(N+1)/2 visible pairs per head; decode: C+1
per sequence); softmax, soft-cap and sinks are not counted.

Tolerance: class ``attention`` (bf16 atol 0.12 x the output's rms, at most 0.12; rtol 1.6e-2;
:data:`kb_nano.operators.base.TOLERANCES`):
the eager baseline rounds the probabilities to the model dtype before ``p @ v`` and the
output sums up to C+1 such terms, where a flash kernel keeps them in fp32, so correct
kernels differ by a few output ulps.
"""

from __future__ import annotations

import torch
from torch import nn

from kb_nano.operators import attention_scenarios as scenarios
from kb_nano.operators import mla
from kb_nano.operators.attention_scenarios import DEFAULT_CONTEXT_LENS
from kb_nano.operators.base import TOLERANCES, Operator


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[B, kv_heads, S, D] -> [B, kv_heads * n_rep, S, D]`` (transformers ``repeat_kv``)."""
    if n_rep == 1:
        return x
    b, kv, s, d = x.shape
    return x[:, :, None, :, :].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


class Attention(nn.Module):
    """Scaled dot-product attention of one TP rank with vLLM's signature.

    Args:
        num_heads: query heads on this rank (``num_attention_heads / tp``).
        head_size: ``head_dim``.
        scale: softmax scale (``head_dim ** -0.5``; Gemma-2: ``query_pre_attn_scalar ** -0.5``).
        num_kv_heads: KV heads on this rank (divided, or 1 replicated head when tp > kv heads);
            default ``num_heads`` (MHA).
        logits_soft_cap: ``cap * tanh(scores / cap)`` before masking (Gemma-2 ``attn_logit_softcapping``).
        per_layer_sliding_window: W: the query at position i sees only keys at positions
            > i - W (a sliding-window layer); None: every earlier key.
        attention_chunk_size: C: the query at position i sees only the earlier keys of
            its own chunk, positions floor(i / C) * C .. i (vLLM ``ChunkedLocalAttention``,
            Llama-4's layers with rotation: transformers' ``chunked_attention`` layers).
        prefix: layer name (unused; vLLM signature).
        sinks: True: the layer has attention sinks (gpt-oss), a per-head sink logit held as
            the parameter ``sinks`` ``[num_heads]`` (vLLM passes the model's ``sinks``
            tensor, split by heads across TP ranks; here the baseline's state_dict carries
            it); see :meth:`_sink_probs`.
        kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: all set for MLA
            (DeepSeek-V3: 512, 128, 64, 128; ``head_size = kv_lora_rank + qk_rope_head_dim``,
            ``num_kv_heads = 1``, as vLLM builds MLA; ``ValueError`` otherwise).
    Forward:
        query ``[N, num_heads * head_size]``; key, value ``[N, num_kv_heads * head_size]``
        (after RoPE); key_cache, value_cache (kb-nano addition: vLLM reads them from the
        forward context) ``[N, context_len, num_kv_heads, head_size]`` or None.
        Without caches: causal attention over one sequence of N tokens. With caches: N
        sequences, token i attends to ``key_cache[i]`` and to its own key.
    Returns ``[N, num_heads * head_size]`` in the query dtype. Parameters: ``sinks`` only
    when built with ``sinks=True``.
    MLA forward (built with ``kv_lora_rank``), per rank:
        prefill ``forward(query, key, value)``: query, key ``[N, num_heads, qk_nope_head_dim
        + qk_rope_head_dim]`` (``q_nope ++ q_pe`` after rotary; ``k_nope`` from
        ``kv_b_proj`` ++ the rotated ``k_pe``, repeated per head), value ``[N, num_heads,
        v_head_dim]``: causal attention over one sequence, returns ``[N, num_heads *
        v_head_dim]`` (:func:`~kb_nano.operators.mla.mla_prefill`).
        decode ``forward(query, kv_cache)`` (passed as ``key``; no value): query ``[N,
        num_heads, head_size]`` (``q_nope @ W_UK`` ++ ``q_pe``), kv_cache ``[N, C + 1,
        head_size]`` (each sequence's latents ``kv_c ++ k_pe``, its new token last),
        values = ``kv_cache[..., :kv_lora_rank]``: returns ``[N, num_heads, kv_lora_rank]``
        before ``W_UV`` (:func:`~kb_nano.operators.mla.mla_decode`).
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        logits_soft_cap: float | None = None,
        per_layer_sliding_window: int | None = None,
        prefix: str = "",
        attention_chunk_size: int | None = None,
        sinks: bool = False,
        kv_lora_rank: int | None = None,
        qk_nope_head_dim: int | None = None,
        qk_rope_head_dim: int | None = None,
        v_head_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.mla_dims = mla.mla_dims(head_size, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        self.num_queries_per_kv = self.num_heads // self.num_kv_heads
        self.logits_soft_cap = logits_soft_cap
        self.sliding_window = per_layer_sliding_window
        self.chunk_size = attention_chunk_size
        self.prefix = prefix
        if sinks:  # the sink logits a scenario measures with (:func:`sink_logits`)
            self.sinks = nn.Parameter(sink_logits(num_heads), requires_grad=False)
        else:
            self.sinks = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor | None = None,
        key_cache: torch.Tensor | None = None,
        value_cache: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.mla_dims is not None:
            if value is None:  # absorbed decode: key is the latent cache
                return mla.mla_decode(query, key, self.mla_dims["kv_lora_rank"], self.scale)
            return mla.mla_prefill(query, key, value, self.scale)
        n = query.shape[0]
        q = query.view(n, self.num_heads, self.head_size)
        k = key.view(n, self.num_kv_heads, self.head_size)
        v = value.view(n, self.num_kv_heads, self.head_size)
        if key_cache is None:
            # prefill: batch 1, sequence n -> [1, heads, n, d]
            q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            pos = torch.arange(n, device=query.device)
            mask = self._hidden(pos[:, None], pos[None, :])
        else:
            # decode: batch n, one query each, keys = cache + own -> [n, kv, C + 1, d]
            q = q.unsqueeze(2)
            k = torch.cat((key_cache, k.unsqueeze(1)), dim=1).transpose(1, 2)
            v = torch.cat((value_cache, v.unsqueeze(1)), dim=1).transpose(1, 2)
            ctx = key_cache.shape[1]  # the query sits at position ctx
            mask = None  # (decided on the host: no sync in the timed call)
            if (self.sliding_window and ctx + 1 > self.sliding_window) or (self.chunk_size and ctx >= self.chunk_size):
                mask = self._hidden(ctx, torch.arange(ctx + 1, device=query.device))
        k = repeat_kv(k, self.num_queries_per_kv)
        v = repeat_kv(v, self.num_queries_per_kv)
        if self.logits_soft_cap:  # float32 logits: see the module docstring
            scores = torch.matmul(q.float(), k.float().transpose(2, 3)) * self.scale
            scores = torch.tanh(scores / self.logits_soft_cap) * self.logits_soft_cap
        else:
            scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        if self.sinks is not None:
            probs = self._sink_probs(scores).to(q.dtype)
        else:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v)  # [B, heads, S, d]
        if key_cache is None:
            return out[0].transpose(0, 1).reshape(n, self.num_heads * self.head_size)
        return out.reshape(n, self.num_heads * self.head_size)

    def _hidden(self, query_pos: torch.Tensor | int, key_pos: torch.Tensor) -> torch.Tensor:
        """Bool mask, True where the query at ``query_pos`` does not see the key at
        ``key_pos`` (broadcast): a later key, one out of the sliding window, or one in an
        earlier chunk."""
        ahead = query_pos - key_pos
        hidden = ahead < 0
        if self.sliding_window:
            hidden = hidden | (ahead >= self.sliding_window)
        if self.chunk_size:
            hidden = hidden | (query_pos // self.chunk_size != key_pos // self.chunk_size)
        return hidden

    def _sink_probs(self, scores: torch.Tensor) -> torch.Tensor:
        """Softmax over ``scores`` ``[B, heads, S, keys]`` with each head's sink logit as an
        extra key, which is then dropped (so a row's probabilities sum to 1 - the sink's
        share), as transformers' gpt-oss ``eager_attention_forward`` computes it: the sink
        column joins the logits in their dtype (bf16 logits and bf16 sinks stay bf16), the
        row maximum is subtracted in that dtype and the softmax is taken in it too."""
        b, h, s, _ = scores.shape
        sinks = self.sinks.reshape(1, h, 1, 1).expand(b, h, s, 1)
        combined = torch.cat((scores, sinks), dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        return torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]


# Sink logits of the baseline (float32 before the module is cast to the scenario dtype):
# spread evenly over [0, SINK_MAX] across the heads, in a random order. On N(0, 1) q and k
# a logit has variance d * scale^2 = 1, so n visible keys weigh about n * e^0.5 and a sink
# s takes the share e^s / (e^s + 1.65 n): from every head near 1 for the first tokens of a
# prefill to a share between 10 % and 90 % for some heads at any n up to 2^16 (ln(1.65 *
# 2^16) = 11.6 - 2.2 .. + 2.2), and near 0 for small s at long contexts. A kernel that
# ignores the sinks gives the undamped output on the heads with a large share and fails.
SINK_MAX = 12.0


def sink_logits(num_heads: int) -> torch.Tensor:
    """``[num_heads]`` float32 sink logits: ``SINK_MAX * (i + U(0, 1)) / num_heads`` for
    head slot i, the slots permuted at random (``torch``'s global generator, which the
    baseline's worker seeds with the parameter seed)."""
    slots = torch.randperm(num_heads).float()
    return (slots + torch.rand(num_heads)) * (SINK_MAX / num_heads)


# the candidate contract beyond the signatures (``kernels --list``)
ATTENTION_CONTRACT = (
    "prefill forward(query[N, H*D], key[N, KV*D], value[N, KV*D]) -> [N, H*D]: causal over one sequence of N "
    "tokens; decode forward(query, key, value of each sequence's new token, key_cache[N, C, KV, D], "
    "value_cache[N, C, KV, D] of its C earlier tokens) -> [N, H*D]. Semantics a candidate lists in "
    "supported_semantics to run those scenarios: sliding_window (per_layer_sliding_window), chunked_attention "
    "(attention_chunk_size), sinks (sinks=True: parameter sinks[H]), mla"
)

OPERATORS = {
    "attention": Operator(
        name="attention",
        level=2,
        category="attention",
        baseline=Attention,
        init_args=scenarios.init_args,
        inputs=scenarios.inputs,
        traffic=scenarios.traffic,
        used_in="layers.*.self_attn.attn (after qkv_proj, rotary_emb and any q/k norm; Llama-4's layers without "
        "rotation scale q by position first, unmeasured; before o_proj)",
        variants=scenarios.variants,
        tolerance=dict(TOLERANCES["attention"]),
        semantics=scenarios.semantics,
        reads_module_tree=True,
        layer_kinds=scenarios.layer_kinds,
        map_variants=lambda facts: mla.map_variants(facts, DEFAULT_CONTEXT_LENS[0]),
        contract_note=ATTENTION_CONTRACT + "\n" + mla.MLA_CONTRACT,
    ),
}
