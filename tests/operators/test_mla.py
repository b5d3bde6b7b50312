"""Multi-head latent attention (DeepSeek-V3) in the ``attention`` operator: the baseline's
prefill (decompressed q/k/v) and absorbed decode (576-wide query against the latent cache)
reproduce transformers' ``DeepseekV3Attention`` from its own projections; the module tree
reads DeepSeek-V3's attention as an ``mla`` layer kind, and the manifest gives its
scenarios with per-rank shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kb_nano.kernels.manifest import generate
from kb_nano.models.configs import config_fields, resolve
from kb_nano.operators.attention import Attention

REPO = Path(__file__).resolve().parents[2]
# the vendored DeepSeek-V3 config at small dims (its yarn rope scaling kept, so the scale
# carries mscale^2): 4 heads, q/kv LoRA ranks 24/32, nope/rope/v head dims 16/8/12 (v
# differs from nope, so a swapped split shows)
SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 24}
SMALL.update(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, num_hidden_layers=1)
H, L, P, R, V = 4, 32, 16, 8, 12


def _small_deepseek_attention(dtype: torch.dtype, interleave: bool):
    """``DeepseekV3Attention`` (eager) of the vendored config at :data:`SMALL` dims on the
    CPU with N(0, 0.3^2) weights (norm weights 1 + N(0, 0.1^2)), and its rotary
    embedding module."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    from kb_nano.operators.hf_modules import hf_config

    config = hf_config({**config_fields(resolve("deepseek-v3", REPO), REPO), **SMALL})
    config.rope_interleave = interleave
    module = DeepseekV3Attention(config, 0).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "layernorm" in name else 0.3 * noise)
    return module.to(dtype), DeepseekV3RotaryEmbedding(config)


def _latents(module, hidden, cos, sin):
    """What ``DeepseekV3Attention.forward`` computes before its attention, from its own
    projections and rotary function: ``q_nope [B, H, S, P]``, rotated ``q_pe [B, H, S, R]``,
    normalized ``kv_c [B, S, L]`` and rotated ``k_pe [B, S, R]``."""
    import transformers.models.deepseek_v3.modeling_deepseek_v3 as ds

    b, s, _ = hidden.shape
    q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden))).view(b, s, H, P + R).transpose(1, 2)
    q_nope, q_pe = q.split([P, R], dim=-1)
    kv_c, k_pe = module.kv_a_proj_with_mqa(hidden).split([L, R], dim=-1)
    kv_c = module.kv_a_layernorm(kv_c)
    rotate = ds.apply_rotary_pos_emb_interleave if module.config.rope_interleave else ds.apply_rotary_pos_emb
    q_pe, k_pe = rotate(q_pe, k_pe.view(b, 1, s, R), cos, sin)
    return q_nope, q_pe, kv_c, k_pe[:, 0]


def _baseline(module) -> Attention:
    """The baseline as the manifest builds it for this layer (:func:`mla_init_args`)."""
    return Attention(H, L + R, module.scaling, 1, kv_lora_rank=L, qk_nope_head_dim=P, qk_rope_head_dim=R, v_head_dim=V)


TOL = {torch.float32: (2e-5, 1e-4), torch.float64: (1e-10, 1e-10)}
# the hidden states: random, x 8 (the rotary part of the logits, which no norm bounds, makes
# the softmax nearly one-hot) and with all-zero rows (zero latents: keys of logit 0)
EDGES = {
    "random": lambda t: t,
    "large": lambda t: t * 8,
    "zero_rows": lambda t: t.index_fill(-2, torch.tensor([0, 4]), 0),
}


@pytest.mark.parametrize("edge", list(EDGES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved_rope", "half_rope"])
def test_mla_prefill_equals_transformers_deepseek_v3_attention(dtype, interleave, edge):
    module, rotary = _small_deepseek_attention(dtype, interleave)
    # the yarn scale: (P + R)^-0.5 * (0.1 * ln(40) + 1)^2, not the plain head scale
    assert module.scaling == pytest.approx((P + R) ** -0.5 * (0.1 * torch.log(torch.tensor(40.0)).item() + 1) ** 2)
    n = 11
    gen = torch.Generator().manual_seed(1)
    hidden = EDGES[edge](torch.randn(1, n, 64, generator=gen)).to(dtype)
    cos, sin = (t.to(dtype) for t in rotary(hidden, torch.arange(n)[None]))
    causal = torch.full((n, n), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]
    with torch.no_grad():
        ref, _ = module(hidden, (cos, sin), causal)
        q_nope, q_pe, kv_c, k_pe = _latents(module, hidden, cos, sin)
        # decompression through kv_b_proj, as vLLM's prefill does
        k_nope, value = module.kv_b_proj(kv_c[0]).view(n, H, P + V).split([P, V], dim=-1)
        query = torch.cat((q_nope, q_pe), -1)[0].transpose(0, 1)  # [n, H, P + R]
        key = torch.cat((k_nope, k_pe[0][:, None].expand(n, H, R)), -1)
        out = _baseline(module)(query, key, value.contiguous())
        assert out.shape == (n, H * V)
        torch.testing.assert_close(module.o_proj(out)[None], ref, atol=TOL[dtype][0], rtol=TOL[dtype][1])


@pytest.mark.parametrize("edge", list(EDGES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved_rope", "half_rope"])
def test_mla_absorbed_decode_equals_transformers_deepseek_v3_attention_with_a_cache(dtype, interleave, edge):
    """Each of B sequences is prefilled with C tokens into a transformers cache, then
    decodes one token; the baseline's absorbed decode over the latent cache of C + 1 tokens
    (W_UK folded into the query, W_UV applied to its output) gives the same output."""
    from transformers import DynamicCache

    module, rotary = _small_deepseek_attention(dtype, interleave)
    b, ctx = 3, 9
    gen = torch.Generator().manual_seed(2)
    hidden = EDGES[edge](torch.randn(b, ctx + 1, 64, generator=gen)).to(dtype)
    cos, sin = (t.to(dtype) for t in rotary(hidden, torch.arange(ctx + 1)[None].expand(b, -1)))
    causal = torch.full((ctx, ctx), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]
    cache = DynamicCache()
    with torch.no_grad():
        module(hidden[:, :ctx], (cos[:, :ctx], sin[:, :ctx]), causal, past_key_values=cache)
        ref, _ = module(hidden[:, ctx:], (cos[:, ctx:], sin[:, ctx:]), None, past_key_values=cache)
        q_nope, q_pe, kv_c, k_pe = _latents(module, hidden, cos, sin)
        w = module.kv_b_proj.weight.view(H, P + V, L)
        w_uk, w_uv = w[:, :P], w[:, P:]  # [H, P, L], [H, V, L]
        ql_nope = torch.einsum("bhp,hpl->bhl", q_nope[:, :, ctx], w_uk)
        query = torch.cat((ql_nope, q_pe[:, :, ctx]), -1)  # [B, H, L + R]
        kv_cache = torch.cat((kv_c, k_pe), -1)  # [B, C + 1, L + R]: the new token's latent last
        latent = _baseline(module)(query, kv_cache)
        assert latent.shape == (b, H, L)
        out = torch.einsum("bhl,hvl->bhv", latent, w_uv).reshape(b, 1, H * V)
        torch.testing.assert_close(module.o_proj(out), ref, atol=TOL[dtype][0], rtol=TOL[dtype][1])


def test_mla_needs_all_its_dimensions():
    with pytest.raises(ValueError, match="needs all of kv_lora_rank"):
        Attention(4, 40, 0.1, 1, kv_lora_rank=32, qk_rope_head_dim=8)
    with pytest.raises(ValueError, match="head_size = kv_lora_rank"):
        Attention(4, 192, 0.1, 1, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)


def test_deepseek_v3_attention_is_an_mla_kind_with_per_rank_scenarios():
    from kb_nano.models.module_tree import read

    layers = read(config_fields(resolve("deepseek-v3", REPO), REPO))["attention_layers"]
    mla = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
    (kind,) = layers["kinds"]
    assert layers["reason"] is None and kind["mla"] == mla and kind["layers"] == 61
    assert kind["scale"] == pytest.approx(192**-0.5 * (0.1 * torch.log(torch.tensor(40.0)).item() + 1) ** 2)
    m = generate(["deepseek-v3"], [8], [4], "auto", REPO, targets=["attention"], context_lens=[16])
    by_id = {s["scenario_id"]: s for s in m["scenarios"]}
    assert sorted(by_id) == [
        "attention__deepseek-v3__tp8__n4__ctx16__mla",
        "attention__deepseek-v3__tp8__n4__mla",
    ]
    prefill, decode = (
        by_id["attention__deepseek-v3__tp8__n4__mla"],
        by_id["attention__deepseek-v3__tp8__n4__ctx16__mla"],
    )
    assert prefill["semantics"] == decode["semantics"] == "mla"
    assert prefill["init_args"] == {"num_heads": 16, "head_size": 576, "scale": kind["scale"], "num_kv_heads": 1, **mla}
    assert [(i["name"], i["shape"]) for i in prefill["inputs"]] == [
        ("query", [4, 16, 192]),
        ("key", [4, 16, 192]),
        ("value", [4, 16, 128]),
    ]
    assert [(i["name"], i["shape"]) for i in decode["inputs"]] == [("query", [4, 16, 576]), ("kv_cache", [4, 17, 576])]
    # the baseline runs the manifest's inputs: [N, H * 128] and [N, H, 512]
    with torch.no_grad():
        ours = Attention(**prefill["init_args"])
        assert ours(*(torch.randn(i["shape"]) for i in prefill["inputs"])).shape == (4, 16 * 128)
        assert ours(*(torch.randn(i["shape"]) for i in decode["inputs"])).shape == (4, 16, 512)
    # FLOPs: 2 * (192 + 128) per causal pair and head; 2 * (576 + 512) per cached key and head
    assert prefill["flops"] == 2 * 16 * 320 * 10 and decode["flops"] == 2 * 16 * 1088 * 4 * 17


def test_an_mla_class_kb_nano_has_not_tested_is_not_covered(monkeypatch):
    from kb_nano.models.module_tree import read
    from kb_nano.operators import mla

    monkeypatch.setattr(mla, "COVERED_MLA", ())
    layers = read(config_fields(resolve("deepseek-v3", REPO), REPO))["attention_layers"]
    assert layers == {
        "kinds": [],
        "reason": "not covered: DeepseekV3Attention is multi-head latent attention kb-nano has not tested the "
        "baseline against",
    }


def test_map_shows_mla_prefill_and_decode_per_rank_and_list_shows_the_mla_contract():
    from kb_nano.operators.listing import ModelExamples, map_tables, operator_table

    (table,) = map_tables(ModelExamples(REPO, ["deepseek-v3"], [1, 8]))
    rows = {cells[0]: cells[1:] for cells in zip(*(list(c._cells) for c in table.columns), strict=True)}
    assert list(rows["attention (mla)"][2:]) == [
        "prefill: query[N, 128, 192], key[N, 128, 192], value[N, 128, 128]; "
        "decode ctx256: query[N, 128, 576], kv_cache[N, 257, 576]",
        "prefill: query[N, 16, 192], key[N, 16, 192], value[N, 16, 128]; "
        "decode ctx256: query[N, 16, 576], kv_cache[N, 257, 576]",
    ]
    listing, _ = operator_table(ModelExamples(REPO, ["llama31-8b"], [1]), level=2, width=400)
    contract = {cells[0]: cells[4] for cells in zip(*(list(c._cells) for c in listing.columns), strict=True)}
    assert "absorbed decode forward(query[N, H, L+R] = q_nope @ W_UK ++ q_pe" in contract["attention"]
    assert "MLA" not in contract["mlp"]
