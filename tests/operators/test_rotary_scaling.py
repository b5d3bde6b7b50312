"""The ``rotary_embedding`` baseline's scaled rope types (``yarn``, ``longrope``,
``dynamic``, ``linear``) equal transformers' rotary modules for the vendored configs
(gpt-oss-20b, DeepSeek-V3, Phi-3.5-MoE) and for Llama configs with those rope types, on
positions near and beyond ``original_max_position_embeddings``; the manifest's init args
carry the scaling fields; the shipped candidate reproduces the baseline on them."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phimoe.modeling_phimoe import PhimoeRotaryEmbedding
from workflow_helpers import REPO

from kb_nano import operators
from kb_nano.candidates import load_class
from kb_nano.models.configs import load_config, model_facts, resolve
from kb_nano.operators.rotary import RotaryEmbedding

MODELS = REPO / "config/models"
PHI35_MOE = MODELS / "microsoft/Phi-3.5-MoE-instruct"
# near and beyond original_max_position_embeddings (4096 for all three vendored models)
POSITIONS = [0, 1, 2047, 4095, 4096, 4097, 8191, 65537, 131071]


def _rotate_like(rope_module, positions, q, k, head_dim):
    """q/k ``[tokens, heads * head_dim]`` rotated by transformers' ``rope_module`` and the
    ``apply_rotary_pos_emb`` of the modeling file that defines it."""
    apply = importlib.import_module(type(rope_module).__module__).apply_rotary_pos_emb
    n = positions.shape[0]
    qh = q.view(1, n, -1, head_dim).transpose(1, 2)
    kh = k.view(1, n, -1, head_dim).transpose(1, 2)
    with torch.no_grad():
        cos, sin = rope_module(qh, positions[None])
        q_out, k_out = apply(qh, kh, cos, sin)
    return q_out.transpose(1, 2).reshape(n, -1), k_out.transpose(1, 2).reshape(n, -1)


def _assert_rotates_like(ours: RotaryEmbedding, rope_module, positions: list[int], heads: int = 4, kv: int = 2):
    gen = torch.Generator().manual_seed(len(positions))
    d = ours.head_size
    pos = torch.tensor(positions)
    q = torch.randn(len(positions), heads * d, generator=gen)
    k = torch.randn(len(positions), kv * d, generator=gen)
    with torch.no_grad():
        got_q, got_k = ours(pos, q.clone(), k.clone())
    want_q, want_k = _rotate_like(rope_module, pos, q, k, d)
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-5)


def _fp32(args: dict, **changes) -> RotaryEmbedding:
    return RotaryEmbedding(**{**args, "dtype": "float32", **changes})


def _facts(config_dir):
    ref = resolve(str(config_dir), REPO)
    return model_facts(load_config(ref, REPO), ref)


def test_yarn_gpt_oss_equals_transformers(facts_of):
    """gpt-oss-20b: yarn with ``truncate: false`` and the default attention factor
    ``0.1 * ln(32) + 1``, which transformers multiplies cos and sin by."""
    args = operators.get("rotary_embedding").init_args(facts_of("gpt-oss-20b"), 1)
    assert args["rope_scaling"]["rope_type"] == "yarn" and args["rope_scaling"]["truncate"] is False
    assert args["max_position_embeddings"] == 131072 and args["head_size"] == args["rotary_dim"] == 64
    ours = _fp32(args)
    hf = GptOssRotaryEmbedding(AutoConfig.from_pretrained(str(MODELS / "openai/gpt-oss-20b")))
    torch.testing.assert_close(ours._compute_inv_freq(), hf.inv_freq, rtol=0, atol=0)
    assert ours.attention_scaling() == hf.attention_scaling and hf.attention_scaling > 1.3
    _assert_rotates_like(ours, hf, POSITIONS)


def test_yarn_deepseek_v3_equals_transformers(facts_of):
    """DeepSeek-V3's yarn (``mscale`` = ``mscale_all_dim``, truncated correction range): its
    rotary scenario is not covered (MLA), but the rope type's formula is the same."""
    facts = facts_of("deepseek-v3")
    rope = {k: v for k, v in facts["rope"].items() if k != "rope_theta"}
    ours = RotaryEmbedding(64, 64, facts["max_position_embeddings"], facts["rope"]["rope_theta"], True, "float32", rope)
    hf = DeepseekV3RotaryEmbedding(AutoConfig.from_pretrained(str(MODELS / "deepseek-ai/DeepSeek-V3")))
    torch.testing.assert_close(ours._compute_inv_freq(), hf.inv_freq, rtol=0, atol=0)
    assert ours.attention_scaling() == hf.attention_scaling == 1.0
    _assert_rotates_like(ours, hf, POSITIONS + [163839])
    # an explicit attention_factor wins over mscale, as in transformers
    explicit = RotaryEmbedding(64, 64, 16, 10000.0, True, "float32", {**rope, "attention_factor": 0.5})
    assert explicit.attention_scaling() == 0.5
    torch.testing.assert_close(explicit.cos_sin_cache[0], torch.tensor([0.5] * 32 + [0.0] * 32))


def test_longrope_phi35_moe_uses_the_long_factors_as_vllm_does(facts_of):
    """Phi-3.5-MoE: context 131072 > original 4096, so (as vLLM's
    ``Phi3LongRoPEScaledRotaryEmbedding`` with its default ``max_model_len``) every position
    is rotated with ``long_factor`` and ``long_mscale``. transformers' longrope frequencies
    for a sequence beyond the original length are those; ``PhimoeRotaryEmbedding`` scales
    by the same ``long_mscale`` (its frequencies stay the short ones: it never passes the
    sequence length to the init function)."""
    facts = facts_of("phi35-moe")
    args = operators.get("rotary_embedding").init_args(facts, 1)
    scaling = args["rope_scaling"]
    assert scaling["rope_type"] == "longrope" and len(scaling["long_factor"]) == 64
    ours = _fp32(args)
    cfg = AutoConfig.from_pretrained(str(PHI35_MOE))
    long_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, seq_len=4097)
    torch.testing.assert_close(ours._compute_inv_freq(), long_inv, rtol=0, atol=0)
    mscale = cfg.rope_parameters["long_mscale"]
    assert ours.attention_scaling() == mscale
    assert _fp32(args, rope_scaling={**scaling, "short_mscale": 1.0}).attention_scaling() == mscale
    with torch.no_grad():
        cos, _ = PhimoeRotaryEmbedding(cfg)(torch.zeros(1), torch.tensor([[0, 4096]]))
    torch.testing.assert_close(ours.cos_sin_cache[0, 0], cos[0, 0, 0], rtol=0, atol=0)  # cos(0) * long_mscale
    # without the model's own mscales, transformers' longrope module (long factors once a
    # position is beyond the original length) equals the baseline at every position
    plain = {k: v for k, v in cfg.rope_parameters.items() if k not in ("long_mscale", "short_mscale")}
    cfg.rope_parameters = plain
    ours = _fp32(args, rope_scaling={k: v for k, v in plain.items() if k != "rope_theta"})
    _assert_rotates_like(ours, Phi3RotaryEmbedding(cfg), POSITIONS)


def test_longrope_short_context_uses_the_short_factors(tmp_path):
    """A context no longer than the original length: short factors and ``short_mscale``
    (transformers: ``seq_len`` at most ``original_max_position_embeddings``)."""
    raw = json.loads((PHI35_MOE / "config.json").read_text())
    raw["max_position_embeddings"] = 4096
    raw["rope_scaling"]["long_mscale"] = 2.0  # unused: the two are equal in the vendored config
    (tmp_path / "config.json").write_text(json.dumps(raw))
    args = operators.get("rotary_embedding").init_args(_facts(tmp_path), 1)
    ours = _fp32(args)
    cfg = AutoConfig.from_pretrained(str(tmp_path))
    short_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, seq_len=4096)
    torch.testing.assert_close(ours._compute_inv_freq(), short_inv, rtol=0, atol=0)
    assert ours.attention_scaling() == raw["rope_scaling"]["short_mscale"]
    with torch.no_grad():
        cos, _ = PhimoeRotaryEmbedding(cfg)(torch.zeros(1), torch.tensor([[0, 4095]]))
    want = torch.cat([(p * short_inv).cos() for p in (0, 4095)]).view(2, 64) * ours.attention_scaling()
    torch.testing.assert_close(cos[0, :, :64], want, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.cos_sin_cache[[0, 4095], :64], want, rtol=0, atol=1e-6)


def test_longrope_attention_factor_scales_cos_sin_as_transformers_does(tmp_path):
    """A longrope config with ``attention_factor`` and no ``long_mscale``/``short_mscale``:
    cos/sin are multiplied by that factor (transformers' ``_compute_longrope_parameters``),
    not by the default from the context ratio."""
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32}
    rope |= {"original_max_position_embeddings": 2048, "attention_factor": 1.3}
    args, cfg = _llama_with_rope(tmp_path, rope)
    _, scaling = ROPE_INIT_FUNCTIONS["longrope"](cfg)
    assert _fp32(args).attention_scaling() == pytest.approx(scaling) == pytest.approx(1.3)


def _llama_with_rope(tmp_path, rope: dict, max_positions: int = 8192):
    raw = json.loads((MODELS / "meta-llama/Llama-3.2-1B-Instruct/config.json").read_text())
    raw["rope_scaling"] = rope
    raw["max_position_embeddings"] = max_positions
    (tmp_path / "config.json").write_text(json.dumps(raw))
    args = operators.get("rotary_embedding").init_args(_facts(tmp_path), 1)
    return args, AutoConfig.from_pretrained(str(tmp_path))


def test_linear_equals_transformers(tmp_path):
    """Linear scaling: vLLM divides the positions by ``factor``, transformers the
    frequencies; with a power-of-two factor the two round alike."""
    args, cfg = _llama_with_rope(tmp_path, {"rope_type": "linear", "factor": 8.0})
    assert args["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    _assert_rotates_like(_fp32(args), LlamaRotaryEmbedding(cfg), [0, 1, 4095, 4096, 8191])


def test_dynamic_is_vllms_one_cache(tmp_path):
    """Dynamic NTK in vLLM 0.32 (``DynamicNTKScalingRotaryEmbedding``): one cache of
    ``max_position_embeddings`` rows whose base is scaled by ``max_position_embeddings /
    max_trained_positions``; without ``max_trained_positions`` the base stays unscaled,
    which is what transformers computes for positions below ``max_position_embeddings``."""
    args, cfg = _llama_with_rope(tmp_path, {"rope_type": "dynamic", "factor": 4.0})
    ours = _fp32(args)
    assert ours.cos_sin_cache.shape == (8192, 64)
    _assert_rotates_like(ours, LlamaRotaryEmbedding(cfg), [0, 1, 2048, 4096, 8191])
    # with max_trained_positions 2048 the base is transformers' dynamic base for a
    # sequence of 8192 positions in a model trained on 2048
    trained = _fp32(args, rope_scaling={**args["rope_scaling"], "max_trained_positions": 2048})
    cfg.max_position_embeddings = 2048
    want, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, seq_len=8192)
    torch.testing.assert_close(trained._compute_inv_freq(), want, rtol=1e-6, atol=0)


def test_rotate_half_candidate_matches_the_baseline_on_scaled_ropes(facts_of):
    """The shipped candidate reuses the baseline's cos/sin cache, so each rope type's
    frequencies and attention scaling reach it without code of its own."""
    cls = load_class(REPO / "candidates/rotary_embedding/rotate_half.py", "rotary_embedding")
    for key in ("gpt-oss-20b", "phi35-moe"):
        args = {**operators.get("rotary_embedding").init_args(facts_of(key), 1), "dtype": "float32"}
        base, cand = RotaryEmbedding(**args), cls(**args)
        pos, d = torch.tensor(POSITIONS), args["head_size"]
        gen = torch.Generator().manual_seed(1)
        q, k = (torch.randn(len(POSITIONS), heads * d, generator=gen) for heads in (8, 2))
        with torch.no_grad():
            for got, want in zip(cand(pos, q.clone(), k.clone()), base(pos, q.clone(), k.clone()), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "scaling,missing",
    [({"rope_type": "yarn", "factor": 4.0}, "original_max_position_embeddings"), ({"rope_type": "linear"}, "factor")],
)
def test_missing_scaling_field_is_one_line(scaling, missing):
    with pytest.raises(ValueError, match=f"rope_type '{scaling['rope_type']}' needs '{missing}'"):
        RotaryEmbedding(64, 64, 16, 10000.0, True, "float32", scaling)


def test_gemma3_rope_per_layer_type_is_one_kind_per_layer_type(facts_of):
    """Gemma-3's rope parameters are per layer type (sliding layers: default rope, theta
    1e4; full layers: linear x8, theta 1e6): one rotary kind each, named as attention's
    kinds, each equal to transformers' Gemma3RotaryEmbedding for that layer type."""
    from transformers.models.gemma3 import modeling_gemma3

    op = operators.get("rotary_embedding")
    facts = facts_of("gemma3-4b", hf_config=True)
    kinds = op.layer_kinds(facts)
    assert [k for k, _ in kinds] == ["sliding1024", "full"]
    hf = modeling_gemma3.Gemma3RotaryEmbedding(load_config(resolve("gemma3-4b", REPO), REPO))
    gen = torch.Generator().manual_seed(3)
    for (kind, overrides), layer_type in zip(kinds, ("sliding_attention", "full_attention"), strict=True):
        args = op.init_args({**facts, **overrides}, 1)
        assert args["rope_scaling"] == (None if kind.startswith("sliding") else {"rope_type": "linear", "factor": 8.0})
        ours = _fp32(args, max_position_embeddings=8192)
        d, pos = args["head_size"], torch.tensor([0, 1, 1023, 1024, 4095, 8191])
        q, k = torch.randn(len(pos), 4 * d, generator=gen), torch.randn(len(pos), 2 * d, generator=gen)
        with torch.no_grad():
            got_q, got_k = ours(pos, q.clone(), k.clone())
            qh, kh = (t.view(1, len(pos), -1, d).transpose(1, 2) for t in (q, k))
            cos, sin = hf(qh, pos[None], layer_type=layer_type)
            want_q, want_k = modeling_gemma3.apply_rotary_pos_emb(qh, kh, cos, sin)
        torch.testing.assert_close(got_q, want_q.transpose(1, 2).reshape(len(pos), -1), rtol=0, atol=1e-4)
        torch.testing.assert_close(got_k, want_k.transpose(1, 2).reshape(len(pos), -1), rtol=0, atol=1e-4)
