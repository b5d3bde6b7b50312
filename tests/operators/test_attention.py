"""The L2 attention block equals transformers' ``eager_attention_forward`` (Llama; Gemma-2 with
soft-cap) at reduced widths (the semantics do not depend on them); its rules at the real ones.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from operator_helpers import MODELS, randn, shapes
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
from transformers.models.llama.modeling_llama import eager_attention_forward as llama_eager

from kb_nano import operators
from kb_nano.operators.attention import DEFAULT_CONTEXT_LENS, Attention
from kb_nano.operators.base import NotApplicable

# --------------------------------------------------------------------------- attention


def _attn_module(heads, kv_heads):
    return SimpleNamespace(num_key_value_groups=heads // kv_heads, training=False, head_dim=None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_prefill_equals_transformers_eager(dtype, facts_of):
    facts = facts_of("llama31-8b", hf_config=True)
    args, s = shapes("attention", facts, 4, n=9)
    assert args == {"num_heads": 8, "head_size": 128, "scale": 128**-0.5, "num_kv_heads": 2, "logits_soft_cap": None}
    assert s == {"query": [9, 8 * 128], "key": [9, 2 * 128], "value": [9, 2 * 128]}
    n, h, kv, d = 9, 8, 2, 128
    q, k, v = (randn(n, w * d, dtype=dtype, seed=i) for i, w in ((1, h), (2, kv), (3, kv)))
    out = Attention(**args)(q, k, v)
    assert out.shape == (n, h * d) and out.dtype == dtype
    mask = torch.full((n, n), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]
    want, _ = llama_eager(
        _attn_module(h, kv),
        q.view(1, n, h, d).transpose(1, 2),
        k.view(1, n, kv, d).transpose(1, 2),
        v.view(1, n, kv, d).transpose(1, 2),
        mask,
        scaling=args["scale"],
    )
    torch.testing.assert_close(out, want.reshape(n, h * d), rtol=0, atol=0)
    # causal: the first token only sees itself -> its output is its own value, repeated per group
    torch.testing.assert_close(out[0].view(h, d), v[0].view(kv, 1, d).expand(kv, h // kv, d).reshape(h, d))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_decode_equals_transformers_eager(dtype, facts_of):
    facts = facts_of("qwen3-30b-a3b", hf_config=True)  # 32 heads, 4 kv heads: tp 8 replicates one kv head
    args, s = shapes("attention", facts, 8, n=3, context_len=17)
    assert (args["num_heads"], args["num_kv_heads"]) == (4, 1)
    assert s["key_cache"] == s["value_cache"] == [3, 17, 1, 128]
    n, h, kv, d, c = 3, 4, 1, 128, 17
    q, k, v = (randn(n, w * d, dtype=dtype, seed=i) for i, w in ((1, h), (2, kv), (3, kv)))
    kc, vc = randn(n, c, kv, d, dtype=dtype, seed=4), randn(n, c, kv, d, dtype=dtype, seed=5)
    out = Attention(**args)(q, k, v, kc, vc)
    keys = torch.cat((kc, k.view(n, 1, kv, d)), dim=1).transpose(1, 2)
    values = torch.cat((vc, v.view(n, 1, kv, d)), dim=1).transpose(1, 2)
    want, _ = llama_eager(_attn_module(h, kv), q.view(n, h, 1, d), keys, values, None, scaling=args["scale"])
    torch.testing.assert_close(out, want.reshape(n, h * d), rtol=0, atol=0)


def test_attention_gemma2_scale_and_soft_cap_equal_transformers(facts_of):
    facts = facts_of("gemma2-2b", hf_config=True)
    args = operators.get("attention").init_args(facts, 1)
    assert args == {"num_heads": 8, "head_size": 256, "scale": 256**-0.5, "num_kv_heads": 4, "logits_soft_cap": 50.0}
    n, h, kv, d = 6, 8, 4, 256
    q, k, v = (randn(n, w * d, seed=i, std=4) for i, w in ((1, h), (2, kv), (3, kv)))  # large scores: cap matters
    out = Attention(**args)(q, k, v)
    mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
    want, _ = gemma2_eager(
        _attn_module(h, kv),
        q.view(1, n, h, d).transpose(1, 2),
        k.view(1, n, kv, d).transpose(1, 2),
        v.view(1, n, kv, d).transpose(1, 2),
        mask,
        scaling=args["scale"],
        softcap=50.0,
    )
    torch.testing.assert_close(out, want.reshape(n, h * d), rtol=1e-6, atol=1e-6)
    uncapped = Attention(**{**args, "logits_soft_cap": None})(q, k, v)
    assert (uncapped - out).abs().max() > 1e-3


def test_attention_prefill_and_decode_agree():
    # the last prefill token equals a decode step whose cache holds the earlier tokens
    n, h, kv, d = 7, 4, 2, 64
    attn = Attention(h, d, d**-0.5, kv)
    q, k, v = randn(n, h * d, seed=1), randn(n, kv * d, seed=2), randn(n, kv * d, seed=3)
    prefill = attn(q, k, v)
    cache_k, cache_v = k[:-1].view(1, n - 1, kv, d), v[:-1].view(1, n - 1, kv, d)
    decode = attn(q[-1:], k[-1:], v[-1:], cache_k, cache_v)
    torch.testing.assert_close(decode, prefill[-1:], rtol=1e-5, atol=1e-6)


def test_attention_variants_and_limits(facts_of):
    op = operators.get("attention")
    facts = facts_of("qwen3-8b", hf_config=True)  # max_position_embeddings 40960
    assert DEFAULT_CONTEXT_LENS == (256,)
    assert op.variants(facts, {"context_lens": None}) == [("", {}), ("ctx256", {"context_len": 256})]
    assert op.variants(facts, {"context_lens": [128, 4096]}) == [
        ("", {}),
        ("ctx128", {"context_len": 128}),
        ("ctx4096", {"context_len": 4096}),
    ]
    args = op.init_args(facts, 1)
    with pytest.raises(NotApplicable, match="max_position_embeddings=40960"):
        op.inputs(args, facts, 1, 1, "bfloat16", context_len=40960)
    prefill = op.inputs(args, facts, 1, 8, "bfloat16")
    assert op.traffic(args, prefill, "bfloat16")[1] == 4 * 32 * 128 * (8 * 9 // 2)
    with pytest.raises(NotApplicable, match="MAX_DECODE_CACHE_TOKENS"):
        op.inputs(args, facts, 1, 1024, "bfloat16", context_len=8192)
    op.inputs(args, facts, 1, 1024, "bfloat16", context_len=1024)  # 2^20 cached tokens: at the limit
    decode = op.inputs(args, facts, 1, 8, "bfloat16", context_len=100)
    assert op.traffic(args, decode, "bfloat16")[1] == 4 * 32 * 128 * 8 * 101
    assert all(op.applies_to(facts_of(m, hf_config=True)) for m in MODELS)
    with pytest.raises(NotApplicable, match="num_attention_heads"):
        op.init_args(facts_of("qwen25-7b", hf_config=True), 8)
