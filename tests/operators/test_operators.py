"""Each baseline equals its reference implementation numerically, and each operator's
init-args / inputs rules give the per-rank (TP) shapes.

References: transformers (``LlamaRMSNorm``, ``Qwen3RMSNorm``, ``ACT2FN``/``LlamaMLP``,
``LlamaRotaryEmbedding`` + ``apply_rotary_pos_emb``, ``ROPE_INIT_FUNCTIONS``), vLLM's
``forward_native`` formulas written out here, and ``torch.nn.functional.embedding``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, LlamaConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding
from workflow_helpers import REPO

from kb_nano import operators
from kb_nano.errors import KbNanoError
from kb_nano.models.configs import load_config, model_facts, resolve
from kb_nano.operators.activations import SiluAndMul
from kb_nano.operators.base import (
    DTYPES,
    NotApplicable,
    kv_heads_per_rank,
    make_tensor,
    shard,
)
from kb_nano.operators.embedding import VocabParallelEmbedding, pad_vocab_size
from kb_nano.operators.norms import RMSNorm
from kb_nano.operators.rotary import RotaryEmbedding, apply_rotary_emb

LLAMA31_8B_DIR = REPO / "config/models/meta-llama/Llama-3.1-8B-Instruct"
QWEN3_8B_DIR = REPO / "config/models/Qwen/Qwen3-8B"


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(shape, generator=gen(seed), dtype=torch.float32).to(dtype)


# --------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("reference", [LlamaRMSNorm, Qwen3RMSNorm])
def test_rms_norm_equals_transformers(reference, dtype, facts_of):
    facts = facts_of("llama31-8b")
    args = operators.get("rms_norm").init_args(facts, 1)
    assert args == {"hidden_size": 4096, "eps": 1e-5}
    ours = RMSNorm(**args)
    ref = reference(args["hidden_size"], eps=args["eps"])
    weight = 1.0 + 0.5 * randn(args["hidden_size"], seed=1)  # random, not ones
    with torch.no_grad():
        ours.weight.copy_(weight)
    ref.load_state_dict(ours.state_dict(), strict=True)  # same state_dict keys
    ours, ref = ours.to(dtype), ref.to(dtype)
    x = 3.0 * randn(8, args["hidden_size"], dtype=dtype, seed=2)
    with torch.no_grad():
        out = ours(x.clone())
        want = ref(x.clone())
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def _fused_add_rms_norm_reference(x, residual, weight, eps):
    """vLLM ``RMSNorm.forward_native`` with a residual, written out."""
    orig = x.dtype
    s = x.to(torch.float32) + residual.to(torch.float32)
    new_residual = s.to(orig)
    var = s.pow(2).mean(dim=-1, keepdim=True)
    out = (s * torch.rsqrt(var + eps)).to(orig) * weight
    return out, new_residual


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_add_rms_norm_equals_formula(dtype):
    h, eps = 512, 1e-6
    ours = RMSNorm(h, eps=eps)
    with torch.no_grad():
        ours.weight.copy_(1.0 + 0.3 * randn(h, seed=3))
    ours = ours.to(dtype)
    x, residual = randn(6, h, dtype=dtype, seed=4), randn(6, h, dtype=dtype, seed=5)
    x_in, res_in = x.clone(), residual.clone()
    with torch.no_grad():
        out, new_residual = ours(x_in, res_in)
        want_out, want_res = _fused_add_rms_norm_reference(x, residual, ours.weight, eps)
    assert out.dtype == dtype and new_residual.dtype == dtype
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(new_residual, want_res, rtol=0, atol=0)
    torch.testing.assert_close(new_residual, (x.float() + residual.float()).to(dtype), rtol=0, atol=0)
    # the inputs are not modified (the harness still gives each side its own clone)
    assert torch.equal(x_in, x) and torch.equal(res_in, residual)
    # and it is the transformers norm of the summed residual (up to the rounding of the sum)
    ref = LlamaRMSNorm(h, eps=eps).to(dtype)
    ref.load_state_dict(ours.state_dict())
    with torch.no_grad():
        tol = 0 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out, ref(new_residual), rtol=tol, atol=tol)


def test_rms_norm_state_dict_and_default_weight():
    m = RMSNorm(16, eps=1e-5)
    assert list(m.state_dict()) == ["weight"]
    assert torch.equal(m.weight, torch.ones(16))
    assert m.variance_epsilon == 1e-5


# --------------------------------------------------------------------------- SiluAndMul


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_and_mul_equals_transformers_act(dtype):
    d = 96
    x = 4.0 * randn(5, 2 * d, dtype=dtype, seed=6)
    with torch.no_grad():
        out = SiluAndMul()(x.clone())
    gate, up = x[:, :d], x[:, d:]
    want = ACT2FN["silu"](gate) * up
    assert out.shape == (5, d) and out.dtype == dtype
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert list(SiluAndMul().state_dict()) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_and_mul_inside_llama_mlp(dtype):
    """vLLM's merged gate_up_proj -> SiluAndMul -> down_proj equals transformers LlamaMLP."""
    cfg = LlamaConfig(hidden_size=32, intermediate_size=80, hidden_act="silu")
    torch.manual_seed(0)
    mlp = LlamaMLP(cfg).to(dtype)
    x = randn(7, 32, dtype=dtype, seed=7)
    with torch.no_grad():
        want = mlp(x)
        gate_up = torch.cat((mlp.gate_proj(x), mlp.up_proj(x)), dim=-1)
        act = SiluAndMul()(gate_up)
        out = mlp.down_proj(act)
    # fp32: silu of a strided slice vs a contiguous tensor may take another vectorised
    # path (1 ulp), and so may the GEMMs; bf16 rounds those differences away.
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 0, "atol": 0}
    torch.testing.assert_close(act, mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x), **tol)
    torch.testing.assert_close(out, want, **tol)


# --------------------------------------------------------------------------- rotary


def _hf_config(directory: Path, max_positions: int | None = None):
    cfg = AutoConfig.from_pretrained(str(directory))
    if max_positions is not None:
        cfg.max_position_embeddings = max_positions
    return cfg


def _hf_rotate(rope_module, positions, q, k, head_dim):
    """transformers' rotary on q/k laid out [tokens, heads * head_dim]."""
    n = positions.shape[0]
    qh = q.view(1, n, -1, head_dim).transpose(1, 2)  # [1, heads, n, d]
    kh = k.view(1, n, -1, head_dim).transpose(1, 2)
    cos, sin = rope_module(qh, positions[None])  # [1, n, d]
    q_out, k_out = apply_rotary_pos_emb(qh, kh, cos, sin, unsqueeze_dim=1)
    return q_out.transpose(1, 2).reshape(n, -1), k_out.transpose(1, 2).reshape(n, -1)


ROTARY_CASES = [
    # (model key, config dir, transformers rotary class, tp)
    ("llama31-8b", LLAMA31_8B_DIR, LlamaRotaryEmbedding, 1),
    ("llama31-8b", LLAMA31_8B_DIR, LlamaRotaryEmbedding, 4),
    ("qwen3-8b", QWEN3_8B_DIR, Qwen3RotaryEmbedding, 1),
    ("llama32-1b", REPO / "config/models/meta-llama/Llama-3.2-1B-Instruct", LlamaRotaryEmbedding, 2),
]


@pytest.mark.parametrize("key,directory,hf_cls,tp", ROTARY_CASES, ids=[f"{c[0]}-tp{c[3]}" for c in ROTARY_CASES])
def test_rotary_equals_transformers_fp32(key, directory, hf_cls, tp, facts_of):
    facts = facts_of(key)
    op = operators.get("rotary_embedding")
    args = op.init_args(facts, tp)
    args["dtype"] = "float32"
    ours = RotaryEmbedding(**args)
    hf = hf_cls(_hf_config(directory))
    torch.testing.assert_close(ours._compute_inv_freq(), hf.inv_freq, rtol=0, atol=0)

    num_tokens = 13
    specs = op.inputs(args, facts, tp, num_tokens, "float32")
    assert [s["name"] for s in specs] == ["positions", "query", "key"]
    positions, q, k = (make_tensor(s, gen(11), "cpu") for s in specs)
    # include the extremes of the cache
    positions[0], positions[1] = 0, args["max_position_embeddings"] - 1
    with torch.no_grad():
        q_out, k_out = ours(positions, q.clone(), k.clone())
        q_ref, k_ref = _hf_rotate(hf, positions, q, k, args["head_size"])
    assert q_out.shape == q.shape and k_out.shape == k.shape
    torch.testing.assert_close(q_out, q_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(k_out, k_ref, rtol=0, atol=1e-5)


def test_rotary_bf16_close_to_transformers(facts_of):
    facts = facts_of("llama31-8b")
    args = operators.get("rotary_embedding").init_args(facts, 4)
    assert args["dtype"] == "bfloat16"
    ours = RotaryEmbedding(**args)
    assert ours.cos_sin_cache.dtype == torch.bfloat16
    hf = LlamaRotaryEmbedding(_hf_config(LLAMA31_8B_DIR))
    positions = torch.tensor([0, 1, 7, 8191, 8192, 65535, 131071])
    q = randn(7, 8 * 128, dtype=torch.bfloat16, seed=12)
    k = randn(7, 2 * 128, dtype=torch.bfloat16, seed=13)
    with torch.no_grad():
        q_out, k_out = ours(positions, q.clone(), k.clone())
        q_ref, k_ref = _hf_rotate(hf, positions, q, k, 128)
    assert q_out.dtype == torch.bfloat16 and k_out.dtype == torch.bfloat16
    torch.testing.assert_close(q_out, q_ref, rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(k_out, k_ref, rtol=1e-2, atol=2e-2)


def test_rotary_inv_freq_equals_rope_init_functions(facts_of):
    llama = _hf_config(LLAMA31_8B_DIR)
    assert llama.rope_parameters["rope_type"] == "llama3"
    args = operators.get("rotary_embedding").init_args(facts_of("llama31-8b"), 1)
    assert args["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert args["base"] == 500000.0 and args["head_size"] == args["rotary_dim"] == 128
    ours = RotaryEmbedding(**{**args, "max_position_embeddings": 16, "dtype": torch.float32})
    want, scaling = ROPE_INIT_FUNCTIONS["llama3"](llama)
    assert scaling == 1.0
    torch.testing.assert_close(ours._compute_inv_freq(), want, rtol=0, atol=0)

    qwen = _hf_config(QWEN3_8B_DIR)
    qargs = operators.get("rotary_embedding").init_args(facts_of("qwen3-8b"), 1)
    assert qargs["rope_scaling"] is None and qargs["base"] == 1e6
    ours = RotaryEmbedding(**{**qargs, "max_position_embeddings": 16, "dtype": torch.float32})
    want, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(qwen)
    torch.testing.assert_close(ours._compute_inv_freq(), want, rtol=0, atol=0)


def test_rotary_cos_sin_cache_layout():
    ours = RotaryEmbedding(64, 64, 32, 10000.0, True, "float32")
    inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))
    p = 29
    torch.testing.assert_close(ours.cos_sin_cache[p], torch.cat(((p * inv).cos(), (p * inv).sin())))
    assert ours.cos_sin_cache.shape == (32, 64)
    assert ours.state_dict() == {}  # non-persistent: nothing to copy


def test_rotary_partial_rotary_factor_matches_transformers(tmp_path):
    """transformers 5 keeps partial_rotary_factor in rope_parameters; facts must see it."""
    raw = json.loads((REPO / "config/models/meta-llama/Llama-3.2-1B-Instruct/config.json").read_text())
    raw["partial_rotary_factor"] = 0.5
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ref = resolve(str(tmp_path), REPO)
    facts = model_facts(load_config(ref, REPO), ref)
    assert facts["partial_rotary_factor"] == 0.5
    args = operators.get("rotary_embedding").init_args(facts, 1)
    assert args["rotary_dim"] == 32 and args["head_size"] == 64
    cfg = AutoConfig.from_pretrained(str(tmp_path))
    ours = RotaryEmbedding(**{**args, "dtype": "float32", "max_position_embeddings": 64})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg)
    torch.testing.assert_close(ours._compute_inv_freq(), want, rtol=0, atol=0)
    # the part of each head beyond rotary_dim passes through unchanged
    q = randn(3, 2 * 64, seed=14)
    with torch.no_grad():
        q_out, k_out = ours(torch.tensor([1, 5, 63]), q.clone(), None)
    assert k_out is None
    torch.testing.assert_close(q_out.view(3, 2, 64)[..., 32:], q.view(3, 2, 64)[..., 32:], rtol=0, atol=0)


@pytest.mark.parametrize("neox", [True, False])
def test_rotary_equals_complex_rotation(neox):
    """Independent check: rotation of (x1, x2) pairs by angle p * inv_freq as complex numbers;
    neox pairs element i with i + d/2, GPT-J style pairs 2i with 2i + 1."""
    d, heads, n = 16, 3, 5
    ours = RotaryEmbedding(d, d, 50, 10000.0, neox, torch.float64)
    positions = torch.tensor([0, 3, 17, 42, 49])
    x = torch.randn(n, heads * d, generator=gen(15), dtype=torch.float64)
    with torch.no_grad():
        out, _ = ours(positions, x.clone())
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    angle = (positions[:, None].float() * inv).double()[:, None, :]  # fp32 product as the cache
    xh = x.view(n, heads, d)
    if neox:
        pairs = torch.complex(xh[..., : d // 2], xh[..., d // 2 :])
    else:
        pairs = torch.complex(xh[..., ::2], xh[..., 1::2])
    rot = pairs * torch.polar(torch.ones_like(angle), angle)
    if neox:
        want = torch.cat((rot.real, rot.imag), dim=-1)
    else:
        want = torch.stack((rot.real, rot.imag), dim=-1).flatten(-2)
    torch.testing.assert_close(out, want.reshape(n, -1), rtol=1e-6, atol=1e-6)


def test_apply_rotary_emb_identity_at_position_zero():
    x = randn(2, 4, 8, seed=16)
    cos, sin = torch.ones(2, 4), torch.zeros(2, 4)
    torch.testing.assert_close(apply_rotary_emb(x, cos, sin, True), x)
    torch.testing.assert_close(apply_rotary_emb(x, cos, sin, False), x)


def test_rotary_unsupported_rope_type(facts_of):
    with pytest.raises(ValueError, match="proportional"):
        RotaryEmbedding(8, 8, 4, 10000.0, True, "float32", {"rope_type": "proportional"})
    facts = {**facts_of("llama31-8b"), "rope": {"rope_type": "proportional", "rope_theta": 1e4}}
    with pytest.raises(NotApplicable, match="not covered: rope_type 'proportional'"):
        operators.get("rotary_embedding").init_args(facts, 1)


# --------------------------------------------------------------------------- embedding


def test_embedding_tp1_equals_f_embedding():
    vocab, dim = 1000, 24
    m = VocabParallelEmbedding(vocab, dim)
    assert m.weight.shape == (pad_vocab_size(vocab), dim) == (1024, dim)
    assert list(m.state_dict()) == ["weight"]
    ids = torch.randint(0, vocab, (50,), generator=gen(20))
    ids[0], ids[1] = 0, vocab - 1
    with torch.no_grad():
        out = m(ids)
    torch.testing.assert_close(out, F.embedding(ids, m.weight[:vocab]), rtol=0, atol=0)
    # a batch of sequences keeps its shape
    with torch.no_grad():
        assert m(ids.view(5, 10)).shape == (5, 10, dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_tp4_shards_sum_to_full_embedding(dtype):
    vocab, dim, tp = 1000, 16, 4
    per_rank = pad_vocab_size(vocab) // tp  # 256; the last shard holds 24 padding rows
    full = randn(pad_vocab_size(vocab), dim, dtype=dtype, seed=21)
    ids = torch.randint(0, vocab, (64,), generator=gen(22))
    ids[:4] = torch.tensor([0, per_rank - 1, per_rank, vocab - 1])
    total = torch.zeros(ids.shape[0], dim, dtype=dtype)
    for rank in range(tp):
        m = VocabParallelEmbedding(vocab, dim, tp_size=tp, tp_rank=rank).to(dtype)
        assert m.weight.shape == (per_rank, dim)
        assert m.vocab_start_index == rank * per_rank
        assert m.vocab_end_index == min((rank + 1) * per_rank, vocab)
        m.load_state_dict({"weight": full[rank * per_rank : (rank + 1) * per_rank]}, strict=True)
        with torch.no_grad():
            out = m(ids)
        mine = (ids >= rank * per_rank) & (ids < (rank + 1) * per_rank)
        if rank == 0:
            assert bool(mine.any()) and bool((~mine).any())
        torch.testing.assert_close(out[mine], full[ids[mine]], rtol=0, atol=0)
        assert bool((out[~mine] == 0).all())
        total += out  # the all-reduce
    torch.testing.assert_close(total, F.embedding(ids, full[:vocab]), rtol=0, atol=0)


# --------------------------------------------------------------------------- operator rules


def _shapes(op_name, facts, tp, n=4, dtype="bfloat16"):
    op = operators.get(op_name)
    args = op.init_args(facts, tp)
    return args, {s["name"]: s["shape"] for s in op.inputs(args, facts, tp, n, dtype)}


def test_rules_llama31_8b_tp4_per_rank_shapes(facts_of):
    facts = facts_of("llama31-8b")
    assert (facts["hidden_size"], facts["num_attention_heads"], facts["num_key_value_heads"]) == (4096, 32, 8)
    for name in ("rms_norm", "fused_add_rms_norm"):
        args, shapes = _shapes(name, facts, 4)
        assert args["hidden_size"] == 4096  # replicated, never divided
        assert all(shape == [4, 4096] for shape in shapes.values())
    _, shapes = _shapes("silu_and_mul", facts, 4)
    assert shapes == {"x": [4, 2 * 14336 // 4]}
    args, shapes = _shapes("rotary_embedding", facts, 4)
    assert shapes == {"positions": [4], "query": [4, 8 * 128], "key": [4, 2 * 128]}
    args, shapes = _shapes("embedding", facts, 4)
    assert args == {"num_embeddings": 128256, "embedding_dim": 4096, "tp_size": 4, "tp_rank": 0}
    assert shapes == {"input_": [4]}
    # tp=1: nothing divided
    _, shapes = _shapes("rotary_embedding", facts, 1)
    assert shapes["query"] == [4, 32 * 128] and shapes["key"] == [4, 8 * 128]
    _, shapes = _shapes("silu_and_mul", facts, 1)
    assert shapes == {"x": [4, 2 * 14336]}


def test_rules_input_specs_are_complete(facts_of):
    facts = facts_of("llama31-8b")
    for name in operators.names():
        op = operators.get(name)
        if not op.applies_to(facts):  # fused_moe: a dense model has no experts to shape
            continue
        try:
            args = op.init_args(facts, 2)
        except NotApplicable:  # e.g. `model` is measured at tp=1 only
            continue
        specs = op.inputs(args, facts, 2, 3, "bfloat16")
        for spec in specs:
            assert set(spec) == {"name", "shape", "dtype", "init"}
            assert spec["dtype"] in DTYPES
            assert spec["shape"][0] == 3
        nbytes, flops = op.traffic(args, specs, "bfloat16")
        assert isinstance(nbytes, int) and nbytes > 0 and isinstance(flops, int) and flops >= 0
        json.dumps(args)  # manifest-serialisable


def test_rules_tp_not_dividing_heads_is_not_applicable(facts_of):
    facts = facts_of("qwen25-7b")
    assert facts["num_attention_heads"] == 28
    with pytest.raises(NotApplicable) as exc:
        operators.get("rotary_embedding").init_args(facts, 8)
    assert "num_attention_heads" in str(exc.value) and "tp=8" in str(exc.value)
    # intermediate 18944 divides by 8, so silu_and_mul still applies; by 3 it does not
    operators.get("silu_and_mul").init_args(facts, 8)
    with pytest.raises(NotApplicable, match="intermediate_size"):
        operators.get("silu_and_mul").init_args(facts, 3)


def test_rules_kv_heads_replicate_when_tp_exceeds_them(facts_of):
    facts = facts_of("qwen3-30b-a3b")  # 32 heads, 4 kv heads
    _, shapes = _shapes("rotary_embedding", facts, 8)
    assert shapes["query"] == [4, 4 * 128] and shapes["key"] == [4, 1 * 128]
    facts = facts_of("llama31-8b")  # 8 kv heads, tp 16
    _, shapes = _shapes("rotary_embedding", facts, 16)
    assert shapes["query"] == [4, 2 * 128] and shapes["key"] == [4, 128]
    assert kv_heads_per_rank(8, 1) == 8 and kv_heads_per_rank(8, 4) == 2 and kv_heads_per_rank(8, 8) == 1
    assert kv_heads_per_rank(4, 8) == 1 and kv_heads_per_rank(2, 16) == 1
    with pytest.raises(NotApplicable, match="num_key_value_heads"):
        kv_heads_per_rank(8, 12)
    with pytest.raises(NotApplicable, match="num_key_value_heads"):
        kv_heads_per_rank(8, 6)  # tp < kv heads but does not divide them


def test_rules_embedding_tp_must_divide_padded_vocab(facts_of):
    facts = {**facts_of("mixtral-8x7b")}
    assert facts["vocab_size"] == 32000
    operators.get("embedding").init_args(facts, 8)
    with pytest.raises(NotApplicable, match="vocab_size"):
        operators.get("embedding").init_args(facts, 3)


def test_rules_applies_to(facts_of):
    facts = facts_of("llama31-8b")
    assert operators.get("silu_and_mul").applies_to(facts)
    assert not operators.get("silu_and_mul").applies_to({**facts, "hidden_act": "gelu"})


def test_shard():
    assert shard(14336, 4, "intermediate_size") == 3584
    with pytest.raises(NotApplicable, match=r"tp=3 does not divide intermediate_size=14336"):
        shard(14336, 3, "intermediate_size")


def test_catalog():
    level1 = [n for n in operators.names() if operators.CATALOG[n].level == 1]
    assert level1[:2] == ["rms_norm", "fused_add_rms_norm"]
    assert {"silu_and_mul", "rotary_embedding", "embedding"} <= set(level1)
    for name in operators.names():
        op = operators.get(name)
        entry = operators.CATALOG[name]
        assert (op.name, op.level, op.category) == (name, entry.level, entry.category)
    with pytest.raises(KbNanoError) as exc:
        operators.get("flash_attn")
    assert "flash_attn" in str(exc.value) and "\n" not in str(exc.value)


def test_make_tensor_is_seeded_and_typed():
    spec = {"name": "x", "shape": [3, 4], "dtype": "bfloat16", "init": {"dist": "normal", "std": 2.0}}
    a, b = make_tensor(spec, gen(5), "cpu"), make_tensor(spec, gen(5), "cpu")
    assert a.dtype == torch.bfloat16 and a.shape == (3, 4) and torch.equal(a, b)
    ids = make_tensor(
        {"name": "i", "shape": [100], "dtype": "int64", "init": {"dist": "randint", "low": 3, "high": 7}}, gen(0), "cpu"
    )
    assert ids.dtype == torch.int64 and int(ids.min()) >= 3 and int(ids.max()) < 7
    with pytest.raises(ValueError, match="laplace"):
        make_tensor({"name": "x", "shape": [1], "dtype": "float32", "init": {"dist": "laplace"}}, gen(0), "cpu")
