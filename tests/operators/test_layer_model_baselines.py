"""L3 ``decoder_layer`` and L4 ``model`` baselines equal the transformers reference
(``LlamaDecoderLayer``, ``Qwen3DecoderLayer``, ``*ForCausalLM`` built independently here and
given the same weights); weights are real seeded random values."""

from __future__ import annotations

import pytest
import torch
from layer_model_helpers import (
    TINY_LLAMA,
    TINY_QWEN3,
    causal_mask,
    gen,
    hf_reference_config,
    perturb_norms,
    raw,
)
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRotaryEmbedding,
)
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3DecoderLayer,
    Qwen3RotaryEmbedding,
)

from kb_nano.operators.layers import (
    CausalLM,
    DecoderLayer,
)

# --------------------------------------------------------------------------- baselines


LAYER_CASES = [
    # (config, transformers layer, transformers rotary, tp)
    ("meta-llama/Llama-3.2-1B-Instruct", LlamaDecoderLayer, LlamaRotaryEmbedding, 1),
    ("meta-llama/Llama-3.1-8B-Instruct", LlamaDecoderLayer, LlamaRotaryEmbedding, 8),
    ("Qwen/Qwen3-8B", Qwen3DecoderLayer, Qwen3RotaryEmbedding, 8),
]


@pytest.mark.parametrize(
    "hub_id,layer_cls,rotary_cls,tp", LAYER_CASES, ids=[f"{c[0].split('/')[1]}-tp{c[3]}" for c in LAYER_CASES]
)
def test_decoder_layer_equals_transformers(hub_id, layer_cls, rotary_cls, tp):
    config = raw(hub_id)
    torch.manual_seed(0)
    ours = DecoderLayer(config, layer_idx=0, tp_size=tp)
    perturb_norms(ours)
    cfg = hf_reference_config(config, tp)
    ref = layer_cls(cfg, 0)
    ref.load_state_dict(ours.state_dict(), strict=True)  # the transformers keys, exactly
    rotary = rotary_cls(cfg)
    n = 11
    x = torch.randn(n, cfg.hidden_size, generator=gen(1))
    positions = torch.randint(0, cfg.max_position_embeddings, (n,), generator=gen(2))
    positions[0] = cfg.max_position_embeddings - 1
    with torch.inference_mode():
        out = ours(x.clone(), positions)
        cos, sin = rotary(x[None], positions[None])
        want = ref(x[None], attention_mask=causal_mask(n, x.dtype), position_embeddings=(cos, sin))[0]
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    # the per-rank shapes: heads / tp, kv heads / tp, intermediate / tp, hidden and head_dim kept
    attn = ours.self_attn
    assert attn.q_proj.weight.shape == (cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size)
    assert attn.k_proj.weight.shape == (cfg.num_key_value_heads * cfg.head_dim, cfg.hidden_size)
    assert ours.mlp.down_proj.weight.shape == (cfg.hidden_size, config["intermediate_size"] // tp)


@pytest.mark.parametrize("config", [TINY_LLAMA, TINY_QWEN3], ids=["llama", "qwen3"])
def test_decoder_layer_bf16_equals_transformers_with_fp32_rotary(config):
    """bf16 as transformers runs after from_pretrained(dtype=bfloat16): weights bf16, the
    rotary inv_freq float32 (``.to(bfloat16)`` must not round it)."""
    torch.manual_seed(0)
    ours = DecoderLayer(config, layer_idx=1, tp_size=2)
    perturb_norms(ours)
    cfg = hf_reference_config(config, 2)
    ref = type(ours._inner)(cfg, 1)
    ref.load_state_dict(ours.state_dict(), strict=True)
    ours, ref = ours.to(torch.bfloat16), ref.to(torch.bfloat16)
    assert ours.rotary_emb.inv_freq.dtype == torch.float32
    rotary = (LlamaRotaryEmbedding if config["model_type"] == "llama" else Qwen3RotaryEmbedding)(cfg)
    torch.testing.assert_close(ours.rotary_emb.inv_freq, rotary.inv_freq, rtol=0, atol=0)
    n = 9
    x = torch.randn(n, cfg.hidden_size, generator=gen(3)).to(torch.bfloat16)
    positions = torch.randint(0, cfg.max_position_embeddings, (n,), generator=gen(4))
    with torch.inference_mode():
        out = ours(x.clone(), positions)
        cos, sin = rotary(x[None], positions[None])
        want = ref(x[None], attention_mask=causal_mask(n, x.dtype), position_embeddings=(cos, sin))[0]
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize("config", [TINY_LLAMA, TINY_QWEN3], ids=["llama-untied", "qwen3-tied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_equals_transformers(config, dtype):
    torch.manual_seed(0)
    ours = CausalLM(config, num_hidden_layers=2)
    perturb_norms(ours)
    ref = AutoModelForCausalLM.from_config(hf_reference_config(config, num_hidden_layers=2), dtype=torch.float32)
    ref.load_state_dict(ours.state_dict(), strict=True)
    assert ref.config.num_hidden_layers == 2 and len(ours.model.layers) == 2
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == config["tie_word_embeddings"]
    ours, ref = ours.to(dtype).eval(), ref.to(dtype).eval()
    rotary = ref.model.rotary_emb
    rotary.inv_freq = type(rotary)(ref.config).inv_freq  # float32, as from_pretrained(dtype=...) keeps it
    n = 13
    ids = torch.randint(0, config["vocab_size"], (n,), generator=gen(5))
    with torch.inference_mode():
        # positions 0..n-1: transformers builds its own causal mask from them
        out = ours(ids, torch.arange(n))
        want = ref(input_ids=ids[None], use_cache=False).logits[0]
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        # arbitrary positions set the rotary angles; attention stays causal in token order
        positions = torch.randint(0, config["max_position_embeddings"], (n,), generator=gen(6))
        out = ours(ids, positions)
        want = ref(
            input_ids=ids[None],
            position_ids=positions[None],
            attention_mask=causal_mask(n, dtype),
            use_cache=False,
        ).logits[0]
    assert out.shape == (n, config["vocab_size"]) and out.dtype == dtype
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert ours.model.rotary_emb.inv_freq.dtype == torch.float32  # kept under .to(bfloat16)


def test_weights_are_seeded_random_transformers_init():
    config = raw("meta-llama/Llama-3.2-1B-Instruct")
    torch.manual_seed(7)
    a = DecoderLayer(config, tp_size=4)
    torch.manual_seed(7)
    b = DecoderLayer(config, tp_size=4)
    torch.manual_seed(8)
    c = DecoderLayer(config, tp_size=4)
    for name, p in a.named_parameters():
        assert torch.equal(p, b.state_dict()[name]), name  # same seed, same weights
        if name.endswith("layernorm.weight"):
            assert torch.equal(p, torch.ones_like(p))  # transformers: ones (bench perturbs them)
        else:
            assert torch.isfinite(p).all()
            assert abs(float(p.detach().std()) - config["initializer_range"]) < 2e-3, name  # normal(0, 0.02)
            assert not torch.equal(p, c.state_dict()[name]), name
    # the model: every matrix random, the tied head shares the embedding's storage
    torch.manual_seed(7)
    lm = CausalLM(TINY_QWEN3, num_hidden_layers=1)
    for name, p in lm.named_parameters():
        if "norm" not in name:
            assert abs(float(p.detach().std()) - 0.02) < 3e-3, name
    assert set(lm.state_dict()) == {
        *(f"model.layers.0.{k}" for k in DecoderLayer(TINY_QWEN3).state_dict()),
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    }


def test_subclass_without_init_gets_rotary_and_loads_weights():
    class NoInit(DecoderLayer):
        init_weights = False

    torch.manual_seed(0)
    base = DecoderLayer(TINY_LLAMA)
    other = NoInit(TINY_LLAMA)
    torch.testing.assert_close(other.rotary_emb.inv_freq, base.rotary_emb.inv_freq, rtol=0, atol=0)
    other.load_state_dict(base.state_dict(), strict=True)
    x, pos = torch.randn(4, 128, generator=gen(0)), torch.arange(4)
    with torch.inference_mode():
        torch.testing.assert_close(other(x, pos), base(x, pos), rtol=0, atol=0)
