"""Multi-head latent attention (MLA, DeepSeek-V3) in the ``attention`` operator: the two
attention cores vLLM's MLA backends run, and the rules of their scenarios.

An MLA layer caches one latent vector per token instead of per-head keys and values:
``kv_c`` (``kv_lora_rank`` = 512 values, after ``kv_a_layernorm``) and the rotated
``k_pe`` (``qk_rope_head_dim`` = 64), 576 values per token shared by every query head.
vLLM computes the attention in two ways (its MLA backends' common implementation):

- prefill ("compute friendly"): the latents are decompressed by ``kv_b_proj`` into per-head
  ``k_nope`` (``qk_nope_head_dim`` = 128) and ``v`` (``v_head_dim`` = 128); the key of a
  head is ``k_nope ++ k_pe`` (192 wide, ``k_pe`` repeated for every head), its query
  ``q_nope ++ q_pe`` (192), and causal attention runs as ordinary multi-head attention with
  a 192-wide q/k and a 128-wide v: :func:`mla_prefill`, output ``[N, heads * 128]``
  (then ``o_proj``).
- decode ("data-movement friendly", absorbed): ``W_UK`` (the ``k_nope`` rows of
  ``kv_b_proj``) is folded into the query, ``ql_nope = q_nope @ W_UK`` (512 wide per head),
  and the query ``ql_nope ++ q_pe`` (576) attends over the latent cache ``kv_c ++ k_pe``
  (576) as multi-query attention whose values are the cache's first 512 columns
  (``kv_c``): :func:`mla_decode`, output ``[B, heads, 512]`` in latent space, which vLLM
  then multiplies by ``W_UV`` (the ``v`` rows of ``kv_b_proj``) before ``o_proj``.

The softmax scale is ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5`` times ``mscale ** 2``
for yarn rope scaling with ``mscale_all_dim`` (transformers' and vLLM's DeepSeek
attention), read from the model's own module (``scaling``). The decode cache is
contiguous, one row block per sequence, ``[B, C + 1, 576]`` (vLLM's MLA cache is paged
``[blocks, block_size, 576]``; kb-nano models no block table, as for standard decode): its
last row is the new token's latent, which vLLM writes into the cache before the decode
kernel runs, so the new token attends to ``C = context_len`` cached tokens and itself.

Inputs are drawn from N(0, s^2) with s^2 = 1 / (sqrt(d) * scale) (d = 192 in prefill,
576 in decode): logits of variance 1, as standard attention's N(0, 1) inputs give with
``head_dim ** -0.5`` (DeepSeek-V3's yarn scale on N(0, 1) would give a logit spread of
3.2 and nearly one-hot rows). This module does not import :mod:`kb_nano.operators.attention`.
"""

from __future__ import annotations

import torch

from kb_nano.operators.base import element_size, normal, numel, shard

# The dtype of the logits q @ k^T of both cores (float64 inputs stay float64): vLLM's MLA
# kernels (FlashMLA, the Triton MLA decode, flash-attention's prefill) accumulate and keep
# them in float32, and bf16 logits are a different rounding: on DeepSeek-V3's tp8 prefill
# shapes (16-256 tokens, 6 draws each, CPU) the eager baseline with bf16 logits was 0.027
# from the float64 result and torch's SDPA (float32 logits) came within 0.0085 of the
# 2e-2 tolerance of it (and failed 1 of 327680 elements in a 16-token sweep); with float32
# logits 0.021 and 0.016.
LOGITS = torch.float32

# the constructor arguments of ``Attention`` that make it MLA, from the module's config
MLA_DIMS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# the MLA form of the contract as ``kernels --list`` shows it (H heads per rank, P/R/V/L:
# qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank; DeepSeek-V3 128/64/128/512)
MLA_CONTRACT = (
    "MLA (semantics mla; built with kv_lora_rank=L, qk_nope_head_dim=P, qk_rope_head_dim=R, v_head_dim=V, "
    "head_size=L+R, num_kv_heads=1): prefill forward(query[N, H, P+R], key[N, H, P+R], value[N, H, V]) "
    "-> [N, H*V]; absorbed decode forward(query[N, H, L+R] = q_nope @ W_UK ++ q_pe, kv_cache[N, C+1, L+R] "
    "passed as key, no value: latents kv_c ++ k_pe, new token last; values kv_cache[..., :L]) -> [N, H, L] "
    "before W_UV"
)


def mla_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one sequence of N tokens with decompressed keys and values.

    Args:
        query, key: ``[N, heads, qk_nope_head_dim + qk_rope_head_dim]`` (after rotary,
            ``k_pe`` repeated for every head).
        value: ``[N, heads, v_head_dim]``.
        scale: softmax scale.
    Returns ``[N, heads * v_head_dim]`` in the query dtype: transformers'
    ``eager_attention_forward`` with float32 logits (:data:`LOGITS`; softmax in float32,
    the probabilities rounded to the input dtype before ``p @ v``); token i attends to 0..i.
    """
    n, heads, _ = query.shape
    q, k, v = (t.transpose(0, 1) for t in (query, key, value))  # [heads, N, d]
    acc = torch.promote_types(query.dtype, LOGITS)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(1, 2)) * scale
    pos = torch.arange(n, device=query.device)
    scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, v).transpose(0, 1).reshape(n, heads * value.shape[-1])


def mla_decode(query: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int, scale: float) -> torch.Tensor:
    """Absorbed decode: B sequences, one new token each, against their latent caches.

    Args:
        query: ``[B, heads, kv_lora_rank + qk_rope_head_dim]``: ``q_nope @ W_UK`` (per head)
            followed by the rotated ``q_pe``.
        kv_cache: ``[B, S, kv_lora_rank + qk_rope_head_dim]``: each sequence's latents
            ``kv_c ++ k_pe``, the new token's last (S = context_len + 1); one key head
            shared by every query head (MQA).
        kv_lora_rank: the values are ``kv_cache[..., :kv_lora_rank]``.
        scale: softmax scale.
    Returns ``[B, heads, kv_lora_rank]`` in the query dtype (before ``W_UV``): softmax of
    ``query @ kv_cache^T * scale`` (float32 logits, :data:`LOGITS`) in float32, rounded to
    the input dtype, times the values.
    """
    acc = torch.promote_types(query.dtype, LOGITS)
    scores = torch.matmul(query.to(acc), kv_cache.to(acc).transpose(1, 2)) * scale  # [B, heads, S]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, kv_cache[..., :kv_lora_rank])


# The multi-head latent attention classes whose core the baseline is tested equal to
# (tests/operators/test_mla.py), and the children such a module may have
COVERED_MLA = ("DeepseekV3Attention",)
MLA_CHILDREN = {"q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm"}
MLA_CHILDREN |= {"kv_b_proj", "o_proj", "rotary_emb"}


def mla_layer(module: torch.nn.Module) -> dict | str:
    """The MLA dimensions (``{name: int}`` of :data:`MLA_DIMS`, read from the module's
    attributes of those names) of a transformers attention module with a
    ``kv_a_proj_with_mqa`` (meta device is fine), or the ``not covered: ...`` reason: a
    class outside :data:`COVERED_MLA`, or one with children outside :data:`MLA_CHILDREN`
    or parameters of its own."""
    cls = type(module).__name__
    extra = sorted(set(dict(module.named_children())) - MLA_CHILDREN)
    extra += sorted(name for name, _ in module.named_parameters(recurse=False))
    if cls not in COVERED_MLA or extra:
        parts = f" with {', '.join(extra)}" if extra else ""
        return f"not covered: {cls} is multi-head latent attention{parts} kb-nano has not tested the baseline against"
    return {name: int(getattr(module, name)) for name in MLA_DIMS}


def mla_dims(
    head_size: int,
    kv_lora_rank: int | None,
    qk_nope_head_dim: int | None,
    qk_rope_head_dim: int | None,
    v_head_dim: int | None,
) -> dict | None:
    """The MLA dimensions ``Attention`` was built with, as ``{name: value}`` of
    :data:`MLA_DIMS`, or None when none is given (standard attention). Raises
    ``ValueError`` when only some are given or ``head_size`` is not ``kv_lora_rank +
    qk_rope_head_dim``."""
    dims = dict(zip(MLA_DIMS, (kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim), strict=True))
    given = [name for name, value in dims.items() if value is not None]
    if not given:
        return None
    if len(given) < len(MLA_DIMS) or head_size != kv_lora_rank + qk_rope_head_dim:
        raise ValueError(
            f"multi-head latent attention needs all of {', '.join(MLA_DIMS)} and head_size = kv_lora_rank + "
            f"qk_rope_head_dim; got {dims} with head_size={head_size}"
        )
    return dims


def map_variants(facts: dict, context_len: int) -> list[tuple[str, dict]]:
    """The variants ``kernels --map`` shows for an attention layer kind (``Operator.map_variants``):
    an MLA kind's prefill and its decode at ``context_len``, whose inputs differ; else the
    plain variant alone."""
    if not (facts.get("attention_kind") or {}).get("mla"):
        return [("", {})]
    return [("prefill", {}), (f"decode ctx{context_len}", {"context_len": context_len})]


def mla_init_args(kind: dict, num_heads: int, tp: int) -> dict:
    """The ``Attention`` constructor arguments of an MLA layer kind (``kind['mla']``: the
    four :data:`MLA_DIMS` of the module tree) at TP ``tp``: the ``num_heads`` query heads
    split over the ranks (vLLM shards MLA by heads; the latent cache is replicated), one
    KV head of ``kv_lora_rank + qk_rope_head_dim`` (vLLM's MLA ``head_size``, 576), the
    layer's scale. Raises ``NotApplicable`` when tp does not divide the heads."""
    dims = kind["mla"]
    return {
        "num_heads": shard(num_heads, tp, "num_attention_heads"),
        "head_size": dims["kv_lora_rank"] + dims["qk_rope_head_dim"],
        "scale": kind["scale"],
        "num_kv_heads": 1,
        **{name: int(dims[name]) for name in MLA_DIMS},
    }


def mla_inputs(args: dict, num_tokens: int, dtype: str, context_len: int | None) -> list[dict]:
    """Input specs of an MLA scenario: prefill (``context_len`` None) ``query``/``key``
    ``[N, heads, qk_nope + qk_rope]`` and ``value`` ``[N, heads, v_head_dim]``; decode
    ``query`` ``[N, heads, kv_lora_rank + qk_rope]`` and ``kv_cache`` ``[N, context_len + 1,
    kv_lora_rank + qk_rope]``. Std: see the module docstring."""
    h, scale = args["num_heads"], args["scale"]
    if context_len is None:
        d = args["qk_nope_head_dim"] + args["qk_rope_head_dim"]
        std = (d**0.5 * scale) ** -0.5
        return [
            normal("query", [num_tokens, h, d], dtype, std),
            normal("key", [num_tokens, h, d], dtype, std),
            normal("value", [num_tokens, h, args["v_head_dim"]], dtype),
        ]
    d = args["head_size"]
    std = (d**0.5 * scale) ** -0.5
    return [
        normal("query", [num_tokens, h, d], dtype, std),
        normal("kv_cache", [num_tokens, context_len + 1, d], dtype, std),
    ]


def mla_traffic(args: dict, inputs: list[dict]) -> tuple[int, int]:
    """``(bytes, flops)`` of one MLA call: every input and the output moved once; the two
    GEMMs' FLOPs over the visible (query head, query token, key) pairs: 2 * (qk width + v
    width) each (prefill: N(N+1)/2 pairs per head, widths 192 + 128; decode: S = C + 1
    keys per sequence, widths 576 + 512)."""
    h, es = args["num_heads"], element_size(inputs[0]["dtype"])
    n = inputs[0]["shape"][0]
    moved = sum(numel(s) for s in inputs) * es
    if len(inputs) == 3:  # prefill, causal
        width, v = inputs[0]["shape"][2], args["v_head_dim"]
        return moved + n * h * v * es, 2 * h * (width + v) * (n * (n + 1) // 2)
    keys, lora = inputs[1]["shape"][1], args["kv_lora_rank"]
    return moved + n * h * lora * es, 2 * h * (args["head_size"] + lora) * n * keys
