"""The rotary embedding baseline equals transformers (``LlamaRotaryEmbedding`` +
``apply_rotary_pos_emb``, ``ROPE_INIT_FUNCTIONS``) and the complex rotation.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from operator_helpers import gen, randn
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
from workflow_helpers import REPO

from kb_nano import operators
from kb_nano.models.configs import load_config, model_facts, resolve
from kb_nano.operators.base import (
    NotApplicable,
    make_tensor,
)
from kb_nano.operators.rotary import RotaryEmbedding, apply_rotary_emb

LLAMA31_8B_DIR = REPO / "config/models/meta-llama/Llama-3.1-8B-Instruct"
QWEN3_8B_DIR = REPO / "config/models/Qwen/Qwen3-8B"


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


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "linear", "factor": 4.0}])
def test_rotary_cache_in_chunks_equals_one_piece(rope_scaling):
    """The cache is filled a chunk of positions at a time (a 10M-position context in the
    cache's size, not four float32 copies): every element equals the cache computed at once."""
    ours = RotaryEmbedding(64, 64, 1000, 10000.0, True, "bfloat16", rope_scaling)
    t = torch.arange(1000, dtype=torch.float)
    if rope_scaling:
        t = t / 4.0
    freqs = torch.einsum("i,j -> ij", t, ours._compute_inv_freq())
    whole = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(torch.bfloat16)
    for rows in (7, 1000, 1 << 16):
        assert torch.equal(ours._compute_cos_sin_cache(torch.bfloat16, rows=rows), whole)
    assert torch.equal(ours.cos_sin_cache, whole)


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
