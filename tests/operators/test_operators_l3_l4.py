"""L3 ``decoder_layer`` and L4 ``model``: the baselines equal the transformers reference
(``LlamaDecoderLayer``, ``Qwen3DecoderLayer``, ``*ForCausalLM`` built independently here and
given the same weights), weights are real seeded random values, the manifest rules (TP
per-rank shapes, size limits, not-applicable reasons), and the shipped candidates."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRotaryEmbedding,
)
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3DecoderLayer,
    Qwen3RotaryEmbedding,
)
from workflow_helpers import REPO

from kb_nano import operators
from kb_nano.candidates import load_class
from kb_nano.kernels.inputs import randomize_constant_parameters
from kb_nano.kernels.manifest import generate
from kb_nano.kernels.measure import measure_once as measure
from kb_nano.operators.base import NotApplicable, tolerance_for
from kb_nano.operators.hf_modules import config_from_facts, hf_config
from kb_nano.operators.layers import (
    LAYER_MAX_PARAMS,
    MODEL_MAX_PARAMS,
    MODEL_NUM_LAYERS,
    CausalLM,
    DecoderLayer,
)

MODELS = REPO / "config/models"
LAYER_CANDIDATE = REPO / "candidates/decoder_layer/sdpa_fused.py"
MODEL_CANDIDATE = REPO / "candidates/model/sdpa.py"

# Small configs of the two architectures (real field sets, small sizes) for the model-level
# and bf16-accuracy tests; the layer tests also use the vendored real configs.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "num_hidden_layers": 4,
    "vocab_size": 1000,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "torch_dtype": "bfloat16",
}
TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": 3,
    "vocab_size": 1200,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "sliding_window": None,
    "torch_dtype": "bfloat16",
}


def raw(hub_id: str) -> dict:
    return json.loads((MODELS / hub_id / "config.json").read_text())


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def perturb_norms(module: torch.nn.Module) -> None:
    """Norm weights are ones after init; make them tell a candidate that ignores them."""
    randomize_constant_parameters(module, seed=123)


def hf_reference_config(config: dict, tp: int = 1, num_hidden_layers: int | None = None):
    """The per-rank config built by hand (independently of kb_nano.operators.layers)."""
    cfg = AutoConfig.for_model(**config)
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    cfg.head_dim = cfg.head_dim or cfg.hidden_size // heads
    cfg.num_attention_heads = heads // tp
    cfg.num_key_value_heads = max(kv // tp, 1)
    cfg.intermediate_size = cfg.intermediate_size // tp
    if num_hidden_layers:
        cfg.num_hidden_layers = num_hidden_layers
    cfg._attn_implementation = "eager"
    return cfg


def causal_mask(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((n, n), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]


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


# --------------------------------------------------------------------------- rules


def test_manifest_scenarios_of_default_models():
    m = generate(["llama31-8b", "qwen3-8b"], [1, 4], [1, 64], "auto", REPO)
    by_id = {s["scenario_id"]: s for s in m["scenarios"]}
    for key, hub in (("llama31-8b", "meta-llama/Llama-3.1-8B-Instruct"), ("qwen3-8b", "Qwen/Qwen3-8B")):
        for n in (1, 64):
            s = by_id[f"decoder_layer__{key}__tp4__n{n}"]
            assert s["applicable"] and (s["level"], s["category"]) == (3, "layer")
            assert s["init_args"] == {"config": raw(hub), "layer_idx": 0, "tp_size": 4}
            assert [(i["name"], i["shape"], i["dtype"]) for i in s["inputs"]] == [
                ("hidden_states", [n, 4096], "bfloat16"),
                ("positions", [n], "int64"),
            ]
            assert s["bytes_moved"] > 90e6 and s["flops"] > 0
            assert (s["atol"], s["rtol"]) == tolerance_for(operators.get("decoder_layer"), "bfloat16")
            # a full 8B layer is above the size limit
            tp1 = by_id[f"decoder_layer__{key}__tp1__n{n}"]
            assert not tp1["applicable"] and "LAYER_MAX_PARAMS" in tp1["reason"]
            for tp in (1, 4):
                s = by_id[f"model__{key}__tp{tp}__n{n}"]
                assert not s["applicable"] and (s["level"], s["category"]) == (4, "model")
            assert "MODEL_MAX_PARAMS" in by_id[f"model__{key}__tp1__n{n}"]["reason"]
            assert "tp=1 only" in by_id[f"model__{key}__tp4__n{n}"]["reason"]


def test_manifest_small_model_and_tp_rules():
    m = generate(["llama32-1b", "qwen25-7b"], [1, 8], [4], "auto", REPO)
    by_id = {s["scenario_id"]: s for s in m["scenarios"]}
    s = by_id["model__llama32-1b__tp1__n4"]
    assert s["applicable"]
    assert s["init_args"] == {"config": raw("meta-llama/Llama-3.2-1B-Instruct"), "num_hidden_layers": MODEL_NUM_LAYERS}
    assert [i["name"] for i in s["inputs"]] == ["input_ids", "positions"]
    assert s["inputs"][0]["init"] == {"dist": "randint", "low": 0, "high": 128256}
    # the LM head reads its whole (tied) weight: at least vocab x hidden bf16 bytes
    assert s["bytes_moved"] >= 128256 * 2048 * 2
    assert by_id["decoder_layer__llama32-1b__tp1__n4"]["applicable"]  # 61e6 parameters
    assert by_id["decoder_layer__llama32-1b__tp8__n4"]["applicable"]  # 8 kv heads / 8
    bad = by_id["decoder_layer__qwen25-7b__tp8__n4"]
    assert not bad["applicable"] and bad["reason"].endswith("tp=8 does not divide num_attention_heads=28")


def test_param_limits_and_layer_shapes(facts_of):
    facts = facts_of("llama31-8b")
    op = operators.get("decoder_layer")
    with pytest.raises(NotApplicable, match="218e6 parameters"):
        op.init_args({**facts, "hf_config": raw("meta-llama/Llama-3.1-8B-Instruct")}, 1)
    assert LAYER_MAX_PARAMS < 218e6 and MODEL_MAX_PARAMS < 1.49e9
    # kv heads replicate when tp exceeds them (Qwen3-30B-A3B: 4 kv heads, tp 8), MoE widths shard
    cfg = hf_config(raw("Qwen/Qwen3-30B-A3B"), 8)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 1, 128)
    assert cfg.moe_intermediate_size == 768 // 8
    with pytest.raises(NotApplicable, match="num_key_value_heads"):
        hf_config({**TINY_LLAMA, "hidden_size": 384, "num_attention_heads": 24, "num_key_value_heads": 8}, 12)
    with pytest.raises(NotApplicable, match="intermediate_size"):
        hf_config({**TINY_LLAMA, "intermediate_size": 260}, 8)


def test_rules_work_from_facts_alone(facts_of):
    """``kernels --map`` and other callers pass facts without the config.json fields: the
    config rebuilt from facts gives the same layer shapes."""
    facts = facts_of("qwen3-8b")
    op = operators.get("decoder_layer")
    args = op.init_args(facts, 4)
    assert args["config"] == config_from_facts(facts)
    real = op.init_args({**facts, "hf_config": raw("Qwen/Qwen3-8B")}, 4)
    a, b = hf_config(args["config"], 4), hf_config(real["config"], 4)
    for field in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "hidden_act",
        "vocab_size",
        "max_position_embeddings",
    ):
        assert getattr(a, field) == getattr(b, field), field
    assert a.rope_parameters == b.rope_parameters
    specs = op.inputs(args, facts, 4, 3, "bfloat16")
    assert [s["shape"] for s in specs] == [[3, 4096], [3]]
    assert op.traffic(args, specs, "bfloat16") == op.traffic(real, specs, "bfloat16")


def test_sliding_window_longer_than_window_is_not_applicable():
    config = {**TINY_LLAMA, "model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 8}
    del config["rope_scaling"]
    op = operators.get("decoder_layer")
    args = {"config": config, "layer_idx": 0, "tp_size": 1}
    assert op.inputs(args, {}, 1, 8, "bfloat16")
    with pytest.raises(NotApplicable, match="sliding_window=8"):
        op.inputs(args, {}, 1, 9, "bfloat16")


# --------------------------------------------------------------------------- candidates


def _errors(base, cand, inputs):
    """(candidate vs bf16 baseline, bf16 baseline vs float64, candidate vs float64) max-abs errors."""
    with torch.inference_mode():
        truth = copy.deepcopy(base).double()(*[t.double() if t.is_floating_point() else t for t in inputs])
        b = copy.deepcopy(base).to(torch.bfloat16)(
            *[t.to(torch.bfloat16) if t.is_floating_point() else t for t in inputs]
        )
        c = copy.deepcopy(cand).to(torch.bfloat16)(
            *[t.to(torch.bfloat16) if t.is_floating_point() else t for t in inputs]
        )
    err = lambda x, y: float((x.double() - y.double()).abs().max())  # noqa: E731
    return err(c, b), err(b, truth), err(c, truth)


@pytest.mark.parametrize("config", [TINY_LLAMA, TINY_QWEN3], ids=["llama", "qwen3"])
def test_decoder_layer_candidate_sdpa_fused(config):
    cls = load_class(LAYER_CANDIDATE, "decoder_layer")
    torch.manual_seed(0)
    base = DecoderLayer(config, tp_size=2)
    perturb_norms(base)
    cand = cls(config, tp_size=2)
    cand.load_state_dict(base.state_dict(), strict=True)
    n = 24
    x = torch.randn(n, config["hidden_size"], generator=gen(9))
    positions = torch.randint(0, config["max_position_embeddings"], (n,), generator=gen(10))
    with torch.inference_mode():
        torch.testing.assert_close(cand(x, positions), base(x, positions), rtol=1e-5, atol=1e-5)  # float32
    vs_base, base_err, cand_err = _errors(base, cand, [x, positions])
    # bf16: as accurate as the transformers module itself (both against float64)
    assert cand_err <= 1.5 * base_err + 1e-3
    atol, rtol = tolerance_for(operators.get("decoder_layer"), "bfloat16")
    assert vs_base <= atol


def test_model_candidate_sdpa():
    cls = load_class(MODEL_CANDIDATE, "model")
    torch.manual_seed(0)
    base = CausalLM(TINY_QWEN3)
    perturb_norms(base)
    cand = cls(TINY_QWEN3)
    cand.load_state_dict(base.state_dict(), strict=True)
    assert cand.hf_config._attn_implementation == "sdpa" and base.hf_config._attn_implementation == "eager"
    n = 20
    ids = torch.randint(0, TINY_QWEN3["vocab_size"], (n,), generator=gen(11))
    positions = torch.randint(0, TINY_QWEN3["max_position_embeddings"], (n,), generator=gen(12))
    with torch.inference_mode():
        torch.testing.assert_close(cand(ids, positions), base(ids, positions), rtol=1e-5, atol=1e-5)
    vs_base, base_err, cand_err = _errors(base, cand, [ids, positions])
    assert cand_err <= 1.5 * base_err + 1e-3


def test_measure_rows_for_l3_l4(tmp_path):
    """The Tier-1 engine end to end on manifest scenarios (tiny configs, real rules)."""
    cfg_dir = tmp_path / "tiny-llama"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
    m = generate([str(cfg_dir)], [1, 2], [16], "auto", REPO)
    scenarios = {s["scenario_id"]: s for s in m["scenarios"] if s["level"] >= 3}
    assert sorted(scenarios) == [
        "decoder_layer__tiny-llama__tp1__n16",
        "decoder_layer__tiny-llama__tp2__n16",
        "model__tiny-llama__tp1__n16",
        "model__tiny-llama__tp2__n16",
    ]
    settings = {
        "device": "cpu",
        "atol": None,
        "rtol": None,
        "num_warmup": 1,
        "num_runs": 3,
        "num_threads": 1,
        "timeout_s": 300,
    }
    for sid, path, target in (
        ("decoder_layer__tiny-llama__tp2__n16", LAYER_CANDIDATE, "decoder_layer"),
        ("model__tiny-llama__tp1__n16", MODEL_CANDIDATE, "model"),
    ):
        row = measure(scenarios[sid], f"{target}/{path.stem}", path, settings, REPO)
        assert row["status"] == "passed", row["error"]
        assert row["baseline_ms"] > 0 and row["candidate_ms"] > 0
        assert (row["atol"], row["rtol"]) == tolerance_for(operators.get(target), "bfloat16")
    assert not scenarios["model__tiny-llama__tp2__n16"]["applicable"]
