"""New L1 operators (gelu_and_mul, qk_norm, lm_head, sampler) and the L2 blocks (attention,
mlp, fused_moe): each baseline equals its transformers reference on random inputs, the
rules give per-rank shapes, ``applies_to`` follows the architecture, tolerances resolve
as documented.

References: transformers ``ACT2FN["gelu_pytorch_tanh"]`` / ``Gemma2MLP``, ``Qwen3RMSNorm``
as ``Qwen3Attention`` applies it, ``LlamaForCausalLM.lm_head``, ``TopKLogitsWarper`` +
``TopPLogitsWarper``, ``eager_attention_forward`` (Llama; Gemma-2 with soft-cap),
``LlamaMLP``, ``MixtralSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``. L2 blocks are checked
at reduced widths (the semantics do not depend on them) and their rules at the real ones.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import (
    Gemma2Config,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    Qwen3MoeConfig,
)
from transformers.activations import ACT2FN
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper
from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
from transformers.models.llama.modeling_llama import LlamaMLP as HFLlamaMLP
from transformers.models.llama.modeling_llama import eager_attention_forward as llama_eager
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
from workflow_helpers import REPO

from kb_nano import operators
from kb_nano.kernels.compare import compare, tolerance
from kb_nano.kernels.manifest import dumps, generate
from kb_nano.operators.activations import GeluAndMul
from kb_nano.operators.attention import DEFAULT_CONTEXT_LENS, Attention
from kb_nano.operators.base import TOLERANCES, NotApplicable, make_tensor, tolerance_for
from kb_nano.operators.embedding import pad_vocab_size
from kb_nano.operators.lm_head import ParallelLMHead
from kb_nano.operators.mlp import LlamaMLP
from kb_nano.operators.moe import FusedMoE
from kb_nano.operators.norms import QKNorm
from kb_nano.operators.sampler import TopKTopPSampler

NEW = ("gelu_and_mul", "qk_norm", "lm_head", "sampler", "attention", "mlp", "fused_moe")
MODELS = (
    "llama31-8b",
    "llama32-1b",
    "qwen25-7b",
    "qwen3-8b",
    "mistral-7b-v03",
    "mixtral-8x7b",
    "qwen3-30b-a3b",
    "gemma2-2b",
)


def randn(*shape, dtype=torch.float32, seed=0, std=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float32) * std).to(dtype)


def shapes(name, facts, tp, n=4, **extra):
    op = operators.get(name)
    args = op.init_args(facts, tp)
    return args, {s["name"]: s["shape"] for s in op.inputs(args, facts, tp, n, "bfloat16", **extra)}


# --------------------------------------------------------------------------- gelu_and_mul


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gelu_and_mul_equals_transformers_act(dtype):
    x = randn(5, 2 * 96, dtype=dtype, seed=1, std=2.0)
    act = ACT2FN["gelu_pytorch_tanh"]
    out = GeluAndMul(approximate="tanh")(x)
    torch.testing.assert_close(out, act(x[:, :96]) * x[:, 96:], rtol=0, atol=0)
    # the exact (erf) GELU differs: the approximation is not a no-op
    assert not torch.equal(GeluAndMul()(x.float()), GeluAndMul("tanh")(x.float()))
    with pytest.raises(ValueError, match="approximate"):
        GeluAndMul("fast")


def test_gelu_and_mul_inside_gemma2_mlp():
    cfg = Gemma2Config(hidden_size=64, intermediate_size=96, hidden_activation="gelu_pytorch_tanh")
    mlp = Gemma2MLP(cfg)
    x = randn(3, 64, seed=2)
    with torch.no_grad():
        gate_up = torch.cat((mlp.gate_proj(x), mlp.up_proj(x)), dim=-1)
        want = mlp(x)
        got = mlp.down_proj(GeluAndMul("tanh")(gate_up))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_gelu_and_mul_rules_gemma2(facts_of):
    facts = facts_of("gemma2-2b", hf_config=True)
    op = operators.get("gelu_and_mul")
    assert op.applies_to(facts) and not operators.get("silu_and_mul").applies_to(facts)
    assert op.init_args(facts, 4) == {"approximate": "tanh"}
    _, s = shapes("gelu_and_mul", facts, 4)
    assert s == {"x": [4, 2 * 9216 // 4]}


# --------------------------------------------------------------------------- qk_norm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qk_norm_equals_qwen3_q_norm_k_norm(dtype, facts_of):
    facts = facts_of("qwen3-8b", hf_config=True)
    args, s = shapes("qk_norm", facts, 4, n=6)
    assert args == {"num_heads": 8, "num_kv_heads": 2, "head_dim": 128, "eps": 1e-6}
    assert s == {"q": [6, 8 * 128], "k": [6, 2 * 128]}
    ours = QKNorm(**args)
    q_ref, k_ref = Qwen3RMSNorm(128, eps=1e-6), Qwen3RMSNorm(128, eps=1e-6)
    with torch.no_grad():
        ours.q_norm.weight.copy_(1 + 0.3 * randn(128, seed=1))
        ours.k_norm.weight.copy_(1 + 0.3 * randn(128, seed=2))
        q_ref.weight.copy_(ours.q_norm.weight)
        k_ref.weight.copy_(ours.k_norm.weight)
    assert set(ours.state_dict()) == {"q_norm.weight", "k_norm.weight"}
    ours, q_ref, k_ref = ours.to(dtype), q_ref.to(dtype), k_ref.to(dtype)
    q, k = randn(6, 8 * 128, dtype=dtype, seed=3, std=3), randn(6, 2 * 128, dtype=dtype, seed=4, std=3)
    with torch.no_grad():
        q_out, k_out = ours(q.clone(), k.clone())
        # Qwen3Attention: self.q_norm(self.q_proj(x).view(*input_shape, -1, head_dim))
        q_want = q_ref(q.view(6, -1, 128)).reshape(6, -1)
        k_want = k_ref(k.view(6, -1, 128)).reshape(6, -1)
    torch.testing.assert_close(q_out, q_want, rtol=0, atol=0)
    torch.testing.assert_close(k_out, k_want, rtol=0, atol=0)


def test_qk_norm_applies_to_qwen3_only(facts_of):
    applies = {m: operators.get("qk_norm").applies_to(facts_of(m, hf_config=True)) for m in MODELS}
    assert {m for m, a in applies.items() if a} == {"qwen3-8b", "qwen3-30b-a3b"}
    _, s = shapes("qk_norm", facts_of("qwen3-30b-a3b", hf_config=True), 8)  # 4 kv heads: replicated at tp 8
    assert s == {"q": [4, 4 * 128], "k": [4, 128]}


# --------------------------------------------------------------------------- lm_head


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lm_head_equals_transformers_lm_head(dtype):
    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    hf = LlamaForCausalLM(cfg).lm_head.to(dtype)
    ours = ParallelLMHead(1000, 64, params_dtype=dtype)
    assert ours.weight.shape == (pad_vocab_size(1000), 64) == (1024, 64) and ours.weight.dtype == dtype
    assert torch.count_nonzero(ours.weight[1000:]) == 0  # padding rows are zero, as vLLM loads them
    with torch.no_grad():
        ours.weight[:1000].copy_(hf.weight)
    x = randn(5, 64, dtype=dtype, seed=1)
    with torch.no_grad():
        logits = ours(x)
        want = hf(x)
    assert logits.shape == (5, 1024) and logits.dtype == dtype
    torch.testing.assert_close(logits[:, :1000], want, rtol=0, atol=0)
    assert torch.count_nonzero(logits[:, 1000:]) == 0


def test_lm_head_tp_shards_concatenate_to_full_logits():
    full = ParallelLMHead(1000, 64)
    x = randn(3, 64, seed=2)
    parts = []
    for rank in range(4):
        part = ParallelLMHead(1000, 64, tp_size=4, tp_rank=rank)
        assert part.weight.shape == (256, 64)
        with torch.no_grad():
            part.weight.copy_(full.weight[rank * 256 : (rank + 1) * 256])
            parts.append(part(x))
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(parts, dim=-1), full(x), rtol=1e-6, atol=1e-6)


def test_lm_head_rules(facts_of):
    args, s = shapes("lm_head", facts_of("qwen3-8b", hf_config=True), 4, n=2)
    assert args == {
        "num_embeddings": 151936,
        "embedding_dim": 4096,
        "params_dtype": "bfloat16",
        "tp_size": 4,
        "tp_rank": 0,
    }
    assert s == {"hidden_states": [2, 4096]}
    with pytest.raises(NotApplicable, match="vocab_size"):
        operators.get("lm_head").init_args(facts_of("mixtral-8x7b", hf_config=True), 3)
    assert all(operators.get("lm_head").applies_to(facts_of(m, hf_config=True)) for m in MODELS)
    nbytes, flops = operators.get("lm_head").traffic(
        args, operators.get("lm_head").inputs(args, {}, 4, 2, "bfloat16"), "bfloat16"
    )
    assert flops == 2 * 2 * 4096 * 151936 // 4


# --------------------------------------------------------------------------- sampler


def _hf_sample(logits, q, k, p):
    out = []
    for i in range(logits.shape[0]):
        row = logits[i : i + 1].clone()
        row = TopKLogitsWarper(top_k=int(k[i]))(None, row)
        row = TopPLogitsWarper(top_p=float(p[i]))(None, row)
        probs = row.softmax(dim=-1, dtype=torch.float32)
        out.append(int((probs / q[i : i + 1]).argmax(dim=-1)))
    return torch.tensor(out, dtype=torch.int64)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampler_equals_transformers_warpers(seed, facts_of):
    facts = facts_of("llama32-1b", hf_config=True)
    op = operators.get("sampler")
    specs = op.inputs(op.init_args(facts, 1), facts, 1, 16, "bfloat16")
    assert [s["name"] for s in specs] == ["logits", "q", "k", "p"]
    assert [s["dtype"] for s in specs] == ["float32", "float32", "int32", "float32"]
    g = torch.Generator().manual_seed(seed)
    logits, q, k, p = (make_tensor(s, g, "cpu") for s in specs)
    assert logits.shape == (16, 128256) and float(q.min()) > 0 and int(k.min()) >= 1 and float(p.min()) >= 0.5
    ids = TopKTopPSampler()(logits.clone(), q.clone(), k.clone(), p.clone())
    assert ids.dtype == torch.int64 and ids.shape == (16,)
    assert torch.equal(ids, _hf_sample(logits, q, k, p))
    # every sample lies inside its row's top-k
    kth = torch.stack([logits[i].topk(int(k[i])).values[-1] for i in range(16)])
    assert bool((logits.gather(1, ids[:, None])[:, 0] >= kth).all())


def test_sampler_top_k_one_is_greedy_and_q_changes_samples():
    logits = randn(4, 500, seed=3, std=3)
    q = torch.empty(4, 500).exponential_(generator=torch.Generator().manual_seed(0))
    ones = torch.ones(4, dtype=torch.int32)
    assert torch.equal(TopKTopPSampler()(logits, q, ones, torch.full((4,), 0.9)), logits.argmax(-1))
    full = torch.full((4,), 500, dtype=torch.int32)
    a = TopKTopPSampler()(logits, q, full, torch.ones(4))
    b = TopKTopPSampler()(logits, q.flip(-1), full, torch.ones(4))
    assert not torch.equal(a, b)


def test_sampler_same_at_every_tp(facts_of):
    facts = facts_of("qwen3-8b", hf_config=True)
    assert shapes("sampler", facts, 1) == shapes("sampler", facts, 8)


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


# --------------------------------------------------------------------------- mlp


def _load_hf_mlp(hf, ours, d):
    with torch.no_grad():
        hf.gate_proj.weight.copy_(ours.gate_up_proj.weight[:d])
        hf.up_proj.weight.copy_(ours.gate_up_proj.weight[d:])
        hf.down_proj.weight.copy_(ours.down_proj.weight)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mlp_equals_transformers_llama_mlp(dtype):
    cfg = LlamaConfig(hidden_size=128, intermediate_size=352, hidden_act="silu")
    ours = LlamaMLP(128, 352, "silu")
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == {
        "gate_up_proj.weight": (704, 128),
        "down_proj.weight": (128, 352),
    }
    hf = HFLlamaMLP(cfg)
    _load_hf_mlp(hf, ours, 352)
    ours, hf = ours.to(dtype), hf.to(dtype)
    x = randn(7, 128, dtype=dtype, seed=1)
    with torch.no_grad():
        out, want = ours(x), hf(x)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=0)
    torch.testing.assert_close(out, want, **tol)


def test_mlp_gelu_equals_transformers_gemma2_mlp():
    cfg = Gemma2Config(hidden_size=64, intermediate_size=96, hidden_activation="gelu_pytorch_tanh")
    ours, hf = LlamaMLP(64, 96, "gelu_pytorch_tanh"), Gemma2MLP(cfg)
    _load_hf_mlp(hf, ours, 96)
    x = randn(3, 64, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x), rtol=1e-5, atol=1e-6)


def test_mlp_tp_partial_sums_add_up_to_full_mlp():
    full = LlamaMLP(64, 192, "silu")
    x = randn(5, 64, seed=3)
    total = torch.zeros(5, 64)
    for rank in range(4):
        part = LlamaMLP(64, 192, "silu", tp_size=4)
        with torch.no_grad():
            rows = slice(rank * 48, (rank + 1) * 48)
            gate, up = full.gate_up_proj.weight[:192], full.gate_up_proj.weight[192:]
            part.gate_up_proj.weight.copy_(torch.cat((gate[rows], up[rows])))
            part.down_proj.weight.copy_(full.down_proj.weight[:, rows])
            total += part(x)
    with torch.no_grad():
        torch.testing.assert_close(total, full(x), rtol=1e-5, atol=1e-5)


def test_mlp_rules_and_applies_to(facts_of):
    args, s = shapes("mlp", facts_of("llama31-8b", hf_config=True), 4, n=2)
    assert args == {"hidden_size": 4096, "intermediate_size": 14336, "hidden_act": "silu", "tp_size": 4}
    assert s == {"x": [2, 4096]}
    m = LlamaMLP(**{**args, "hidden_size": 8, "intermediate_size": 16})
    assert m.gate_up_proj.weight.shape == (8, 8) and m.down_proj.weight.shape == (8, 4)
    assert operators.get("mlp").init_args(facts_of("gemma2-2b", hf_config=True), 1)["hidden_act"] == "gelu_pytorch_tanh"
    applies = {m: operators.get("mlp").applies_to(facts_of(m, hf_config=True)) for m in MODELS}
    assert {m for m, a in applies.items() if not a} == {"mixtral-8x7b", "qwen3-30b-a3b"}
    with pytest.raises(NotApplicable, match="intermediate_size"):
        operators.get("mlp").init_args(facts_of("llama31-8b", hf_config=True), 3)


# --------------------------------------------------------------------------- fused_moe


def _small_moe(kind):
    common = dict(hidden_size=64, num_experts_per_tok=2, hidden_act="silu")
    if kind == "mixtral":
        cfg = MixtralConfig(intermediate_size=96, num_local_experts=8, **common)
        block, e = MixtralSparseMoeBlock(cfg), 8
    else:
        cfg = Qwen3MoeConfig(moe_intermediate_size=48, num_experts=16, norm_topk_prob=True, **common)
        block, e = Qwen3MoeSparseMoeBlock(cfg), 16
    cfg._experts_implementation = "eager"
    i = block.experts.gate_up_proj.shape[1] // 2
    ours = FusedMoE(e, 2, 64, i, renormalize=True)
    with torch.no_grad():
        block.experts.gate_up_proj.copy_(ours.w13_weight)
        block.experts.down_proj.copy_(ours.w2_weight)
        block.gate.weight.copy_(randn(e, 64, seed=9, std=0.3))
    return block, ours


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_moe_equals_transformers_sparse_moe_block(kind, dtype):
    block, ours = _small_moe(kind)
    block, ours = block.to(dtype), ours.to(dtype)
    x = randn(1, 11, 64, dtype=dtype, seed=1)
    with torch.no_grad():
        want = block(x)[0]
        router_logits = torch.nn.functional.linear(x[0], block.gate.weight)  # vLLM: self.gate(x) outside
        out = ours(x[0].clone(), router_logits)
    assert out.shape == (11, 64) and out.dtype == dtype
    if kind == "mixtral" or dtype == torch.float32:
        # Mixtral keeps fp32 routing weights as the baseline does; fp32 has nothing to round
        tol = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    else:
        # Qwen3-MoE rounds the routing weights to bf16 before scaling each expert's output
        tol = dict(zip(("atol", "rtol"), TOLERANCES["fused"]["bfloat16"]))
    torch.testing.assert_close(out, want, **tol)


def test_fused_moe_without_renormalize_and_tp_partial_sums():
    full = FusedMoE(8, 2, 32, 64, renormalize=False)
    x, logits = randn(6, 32, seed=1), randn(6, 8, seed=2)
    w, ids = full.select_experts(logits)
    torch.testing.assert_close(w, torch.softmax(logits, -1).topk(2).values)
    total = torch.zeros(6, 32)
    for rank in range(2):
        part = FusedMoE(8, 2, 32, 64, renormalize=False, tp_size=2)
        rows = slice(rank * 32, (rank + 1) * 32)
        with torch.no_grad():
            part.w13_weight.copy_(
                torch.cat((full.w13_weight[:, :64][:, rows], full.w13_weight[:, 64:][:, rows]), dim=1)
            )
            part.w2_weight.copy_(full.w2_weight[:, :, rows])
            total += part(x, logits)
    with torch.no_grad():
        torch.testing.assert_close(total, full(x, logits), rtol=1e-5, atol=1e-6)


def test_fused_moe_rules_real_shapes(facts_of):
    op = operators.get("fused_moe")
    args, s = shapes("fused_moe", facts_of("mixtral-8x7b", hf_config=True), 4, n=2)
    assert args == {
        "num_experts": 8,
        "top_k": 2,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "params_dtype": "bfloat16",
        "renormalize": True,
        "tp_size": 4,
    }
    assert s == {"hidden_states": [2, 4096], "router_logits": [2, 8]}
    args, s = shapes("fused_moe", facts_of("qwen3-30b-a3b", hf_config=True), 8, n=2)
    assert (args["num_experts"], args["top_k"], args["intermediate_size"], args["renormalize"]) == (128, 8, 768, True)
    with torch.device("meta"):
        m = FusedMoE(**args)
    assert m.w13_weight.shape == (128, 2 * 96, 2048) and m.w2_weight.shape == (128, 2048, 96)
    assert m.w13_weight.dtype == torch.bfloat16
    applies = {m: op.applies_to(facts_of(m, hf_config=True)) for m in MODELS}
    assert {m for m, a in applies.items() if a} == {"mixtral-8x7b", "qwen3-30b-a3b"}
    # without the raw config fields (kernels --map) a MoE model still counts as MoE
    bare = {k: v for k, v in facts_of("mixtral-8x7b", hf_config=True).items() if k != "hf_config"}
    assert op.applies_to(bare)
    with pytest.raises(NotApplicable, match="expert fields"):
        op.init_args(bare, 1)
    with pytest.raises(NotApplicable, match="intermediate_size"):
        op.init_args(facts_of("qwen3-30b-a3b", hf_config=True), 5)


# --------------------------------------------------------------------------- tolerances


def test_tolerance_classes():
    by_op = {name: operators.get(name).tolerance for name in operators.names()}
    for name in (
        "rms_norm",
        "fused_add_rms_norm",
        "qk_norm",
        "silu_and_mul",
        "gelu_and_mul",
        "embedding",
    ):
        assert by_op[name] == TOLERANCES["pointwise"], name
    assert by_op["rotary_embedding"] == TOLERANCES["rotary"]  # the baseline's own bf16 error (base.py)
    assert by_op["lm_head"] == TOLERANCES["gemm"]
    for name in ("attention", "mlp", "fused_moe"):
        assert by_op[name] == TOLERANCES["fused"], name
    assert by_op["sampler"] == TOLERANCES["exact"]
    assert tolerance_for(operators.get("attention"), "bfloat16") == (2e-2, 1.6e-2)
    assert tolerance_for(operators.get("rms_norm"), "float32") == (1e-5, 1e-5)
    for table in TOLERANCES.values():  # looser for fewer mantissa bits
        assert table["float32"] <= table["float16"] <= table["bfloat16"]


def test_tolerance_rule_config_overrides_operator():
    scenario = {"target": "attention", "dtype": "bfloat16", "atol": 0.02, "rtol": 0.01}
    assert tolerance(scenario, {"atol": None, "rtol": None}) == (0.02, 0.01)
    assert tolerance(scenario, {"atol": 0.5, "rtol": None}) == (0.5, 0.01)
    assert tolerance(scenario, {"atol": 0.001, "rtol": 0.0}) == (0.001, 0.0)
    # a manifest without recorded tolerances falls back to the operator table
    assert tolerance({"target": "rms_norm", "dtype": "float32"}, {}) == (1e-5, 1e-5)


def test_compare_integer_outputs_exactly():
    ref = torch.tensor([5, 100000, 7])
    assert compare(ref, ref.clone(), 0.01, 0.01)[0] == "passed"
    status, error, *_ = compare(ref, torch.tensor([5, 100001, 7]), 1.0, 0.5)  # would pass allclose
    assert status == "incorrect" and "1 of 3" in error


# --------------------------------------------------------------------------- manifest


def test_manifest_variants_ids_and_determinism():
    kw = dict(models=["llama32-1b", "gemma2-2b"], tps=[1, 2], num_tokens=[1, 8], dtype="auto", root=REPO)
    m = generate(**kw, context_lens=[64, 256])
    ids = [s["scenario_id"] for s in m["scenarios"]]
    assert len(ids) == len(set(ids))
    attn = [i for i in ids if i.startswith("attention__llama32-1b__tp1")]
    assert attn == [
        "attention__llama32-1b__tp1__n1",
        "attention__llama32-1b__tp1__n1__ctx64",
        "attention__llama32-1b__tp1__n1__ctx256",
        "attention__llama32-1b__tp1__n8",
        "attention__llama32-1b__tp1__n8__ctx64",
        "attention__llama32-1b__tp1__n8__ctx256",
    ]
    by_id = {s["scenario_id"]: s for s in m["scenarios"]}
    dec = by_id["attention__llama32-1b__tp2__n8__ctx256"]
    assert dec["variant"] == "ctx256" and dec["context_len"] == 256
    assert {i["name"]: i["shape"] for i in dec["inputs"]}["key_cache"] == [8, 256, 4, 64]
    assert "variant" not in by_id["attention__llama32-1b__tp2__n8"]
    # gemma-2-2b is float32: the scenarios and their tolerances follow
    g = by_id["attention__gemma2-2b__tp1__n8__full"]  # (and __sliding4096: the model's layer kinds)
    assert g["dtype"] == "float32" and (g["atol"], g["rtol"]) == (1e-4, 1e-4)
    assert g["init_args"]["logits_soft_cap"] == 50.0
    assert by_id["gelu_and_mul__gemma2-2b__tp2__n8"]["applicable"] is True
    assert by_id["gelu_and_mul__llama32-1b__tp2__n8"]["reason"] == "LlamaForCausalLM does not use gelu_and_mul"
    assert by_id["fused_moe__llama32-1b__tp1__n1"]["applicable"] is False
    assert dumps(generate(**kw, context_lens=[64, 256])) == dumps(m)
    default = generate(**kw)
    assert "attention__llama32-1b__tp1__n1__ctx256" in {s["scenario_id"] for s in default["scenarios"]}


def test_manifest_context_len_not_applicable_and_duplicates():
    from kb_nano.errors import KbNanoError

    m = generate(["gemma2-2b"], [1], [1], "auto", REPO, context_lens=[8192])  # max_position_embeddings 8192
    sc = {s["scenario_id"]: s for s in m["scenarios"]}["attention__gemma2-2b__tp1__n1__ctx8192__full"]
    assert sc["applicable"] is False and "max_position_embeddings=8192" in sc["reason"]
    with pytest.raises(KbNanoError, match="context_lens: 64 listed more than once"):
        generate(["gemma2-2b"], [1], [1], "auto", REPO, context_lens=[64, 64])


def test_new_targets_registered():
    levels = {name: operators.CATALOG[name].level for name in NEW}
    assert levels == {
        "gelu_and_mul": 1,
        "qk_norm": 1,
        "lm_head": 1,
        "sampler": 1,
        "attention": 2,
        "mlp": 2,
        "fused_moe": 2,
    }
    for name in NEW:
        op = operators.get(name)
        assert (op.name, op.level, op.category) == (
            name,
            operators.CATALOG[name].level,
            operators.CATALOG[name].category,
        )
        assert op.used_in
