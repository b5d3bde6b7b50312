"""RMSNorm, fused_add_rms_norm, SiluAndMul and the embedding: each baseline equals its reference
numerically.

References: transformers (``LlamaRMSNorm``, ``Qwen3RMSNorm``, ``ACT2FN``/``LlamaMLP``), vLLM's
``forward_native`` formulas written out here, and ``torch.nn.functional.embedding``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from operator_helpers import gen, randn
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
)
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from kb_nano import operators
from kb_nano.operators.activations import SiluAndMul
from kb_nano.operators.embedding import VocabParallelEmbedding, pad_vocab_size
from kb_nano.operators.norms import RMSNorm

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
