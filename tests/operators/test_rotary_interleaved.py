"""Rotary embedding by interleaved pairs (vLLM ``is_neox_style=False``): the module tree
recognises Llama-4's rotation, the scenario gets the ``interleaved`` semantics, and the
baseline equals transformers' ``Llama4TextRotaryEmbedding`` + ``apply_rotary_emb``.
"""

from __future__ import annotations

import pytest
import torch
from operator_helpers import gen
from transformers import AutoConfig
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.llama import modeling_llama
from transformers.models.llama4 import modeling_llama4
from workflow_helpers import REPO

from kb_nano import operators
from kb_nano.models import module_tree
from kb_nano.models.module_tree import rotates_halves, rotates_pairs
from kb_nano.operators.base import make_tensor
from kb_nano.operators.rotary import RotaryEmbedding

SCOUT_DIR = REPO / "config/models/meta-llama/Llama-4-Scout-17B-16E-Instruct"
TEST_POSITIONS = 65536  # the cache's length in these tests (Scout's own is 10485760)


def test_rotates_pairs_probes_the_rotation():
    """Llama-4's complex rotation is by pairs; the half-split rotations of Llama and gpt-oss
    are not, and Llama-4's is not by halves."""

    class Cohere:  # interleaved rotate_half with cos/sin repeated per pair (Cohere's form)
        @staticmethod
        def apply_rotary_pos_emb(q, k, cos, sin):
            def rot(x):
                return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

            c, s = cos[:, None], sin[:, None]
            return q * c + rot(q) * s, k * c + rot(k) * s

    assert rotates_pairs(modeling_llama4)
    assert rotates_pairs(Cohere)
    assert not rotates_halves(getattr(modeling_llama4, "apply_rotary_pos_emb", None))
    assert not rotates_pairs(modeling_llama)
    assert not rotates_pairs(modeling_gpt_oss)
    assert not rotates_pairs(None)


@pytest.fixture(scope="module")
def scout_facts(facts_of):
    facts = facts_of("llama4-scout", hf_config=True)
    facts.update(module_tree.read(facts["hf_config"]))
    return facts


def test_llama4_rotary_scenario_is_interleaved(scout_facts):
    assert scout_facts["rotary"]["neox"] is False and scout_facts["rotary"]["reason"] is None
    op = operators.get("rotary_embedding")
    assert op.semantics(scout_facts) == "interleaved"
    args = op.init_args(scout_facts, 4)
    assert args["is_neox_style"] is False
    assert args["rope_scaling"]["rope_type"] == "llama3"


def _scout_rotary(scout_facts, tp: int, dtype: str):
    """kb-nano's baseline and transformers' rotary for Scout at ``tp``, the cache cut to
    :data:`TEST_POSITIONS` (llama3 frequencies do not depend on its length)."""
    args = operators.get("rotary_embedding").init_args(scout_facts, tp)
    args.update(dtype=dtype, max_position_embeddings=TEST_POSITIONS)
    ours = RotaryEmbedding(**args)
    hf = modeling_llama4.Llama4TextRotaryEmbedding(AutoConfig.from_pretrained(str(SCOUT_DIR)).get_text_config())
    return args, ours, hf


def _hf_rotate(hf, positions, q, k, head_dim):
    """transformers' Llama-4 rotation of q/k laid out ``[tokens, heads * head_dim]``."""
    n = positions.shape[0]
    qh, kh = q.view(1, n, -1, head_dim), k.view(1, n, -1, head_dim)  # [1, n, heads, d]
    freqs_cis = hf(qh, positions[None])  # [1, n, d / 2] complex
    q_out, k_out = modeling_llama4.apply_rotary_emb(qh, kh, freqs_cis)
    return q_out.reshape(n, -1), k_out.reshape(n, -1)


@pytest.mark.parametrize("tp", [1, 8])
def test_interleaved_baseline_equals_llama4_fp32(scout_facts, tp):
    args, ours, hf = _scout_rotary(scout_facts, tp, "float32")
    torch.testing.assert_close(ours._compute_inv_freq(), hf.inv_freq, rtol=0, atol=0)
    op = operators.get("rotary_embedding")
    specs = op.inputs(args, scout_facts, tp, 9, "float32")
    positions, q, k = (make_tensor(s, gen(5), "cpu") for s in specs)
    positions.random_(0, TEST_POSITIONS, generator=gen(6))
    positions[0], positions[1] = 0, TEST_POSITIONS - 1  # the extremes of the cache
    q[2] *= 100.0  # large magnitudes
    with torch.no_grad():
        q_out, k_out = ours(positions, q.clone(), k.clone())
        q_ref, k_ref = _hf_rotate(hf, positions, q, k, args["head_size"])
    torch.testing.assert_close(q_out, q_ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(k_out, k_ref, rtol=1e-5, atol=1e-4)
    # the half-split rotation is not Llama-4's: a candidate computing it would fail
    halves = RotaryEmbedding(**{**args, "is_neox_style": True})
    with torch.no_grad():
        q_halves, _ = halves(positions, q.clone(), k.clone())
    assert not torch.allclose(q_halves, q_ref, atol=1e-2)


def test_interleaved_baseline_bf16_close_to_llama4(scout_facts):
    args, ours, hf = _scout_rotary(scout_facts, 1, "bfloat16")
    positions = torch.tensor([0, 1, 7, 8191, 8192, 65535])
    g = gen(9)
    q = torch.randn(6, 40 * 128, generator=g).to(torch.bfloat16)
    k = torch.randn(6, 8 * 128, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        q_out, k_out = ours(positions, q.clone(), k.clone())
        q_ref, k_ref = _hf_rotate(hf, positions, q, k, 128)
    tol = operators.get("rotary_embedding").tolerance["bfloat16"]
    torch.testing.assert_close(q_out.float(), q_ref.float(), atol=tol[0], rtol=tol[1])
    torch.testing.assert_close(k_out.float(), k_ref.float(), atol=tol[0], rtol=tol[1])


# --------------------------------------------------------------------------- MLA (DeepSeek-V3)

DEEPSEEK_DIR = REPO / "config/models/deepseek-ai/DeepSeek-V3"


@pytest.fixture(scope="module")
def deepseek_facts(facts_of):
    facts = facts_of("deepseek-v3", hf_config=True)
    facts.update(module_tree.read(facts["hf_config"]))
    return facts


def test_mla_rotary_scenario_turns_the_rope_slice(deepseek_facts):
    """DeepSeek-V3 turns the last 64 dims of each query head and one shared key head, by
    pairs (``rope_interleave``), with its yarn frequencies; the key is one head at any TP."""
    turn = deepseek_facts["rotary"]
    assert turn["reason"] is None and turn["neox"] is False and turn["head_size"] == 64
    op = operators.get("rotary_embedding")
    assert op.semantics(deepseek_facts) == "interleaved"
    for tp, heads in ((1, 128), (8, 16)):
        args = op.init_args(deepseek_facts, tp)
        assert (args["head_size"], args["rotary_dim"], args["is_neox_style"]) == (64, 64, False)
        assert args["rope_scaling"]["rope_type"] == "yarn"
        shapes = [s["shape"] for s in op.inputs(args, deepseek_facts, tp, 3, "bfloat16")]
        assert shapes == [[3], [3, heads * 64], [3, 64]]


def test_mla_rotary_baseline_equals_deepseek_v3(deepseek_facts):
    """The baseline (vLLM's in-place pairs) equals transformers' ``DeepseekV3RotaryEmbedding``
    + ``apply_rotary_pos_emb_interleave``, whose output gathers each pair's two results into
    halves (the same rotation, dims permuted alike in q and k)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    op = operators.get("rotary_embedding")
    args = {**op.init_args(deepseek_facts, 8), "dtype": "float32"}
    ours = RotaryEmbedding(**args)
    hf = ds.DeepseekV3RotaryEmbedding(AutoConfig.from_pretrained(str(DEEPSEEK_DIR)))
    torch.testing.assert_close(ours._compute_inv_freq(), hf.inv_freq, rtol=0, atol=0)
    positions, q, k = (make_tensor(s, gen(7), "cpu") for s in op.inputs(args, deepseek_facts, 8, 6, "float32"))
    positions[0], positions[1], positions[2] = 0, 4095, args["max_position_embeddings"] - 1
    q[3] *= 100.0
    with torch.no_grad():
        q_out, k_out = ours(positions, q.clone(), k.clone())
        q_rot, k_rot = q.view(1, 6, 16, 64).transpose(1, 2), k.view(1, 6, 1, 64).transpose(1, 2)
        cos, sin = hf(q_rot, positions[None])
        q_ref, k_ref = ds.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)

    def gathered(x, heads):  # vLLM's in-place pairs -> transformers' halves
        x = x.view(6, heads, 64)
        return torch.cat((x[..., ::2], x[..., 1::2]), dim=-1).transpose(0, 1)[None]

    torch.testing.assert_close(gathered(q_out, 16), q_ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gathered(k_out, 1), k_ref, rtol=1e-5, atol=1e-4)
