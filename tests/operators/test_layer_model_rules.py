"""The manifest rules of L3 ``decoder_layer`` and L4 ``model``: TP per-rank shapes, size
limits, not-applicable reasons."""

from __future__ import annotations

import pytest
from layer_model_helpers import (
    TINY_LLAMA,
    raw,
)
from workflow_helpers import REPO

from kb_nano import operators
from kb_nano.kernels.manifest import generate
from kb_nano.operators.base import NotApplicable, tolerance_for
from kb_nano.operators.hf_modules import config_from_facts, hf_config
from kb_nano.operators.layers import (
    LAYER_MAX_PARAMS,
    MODEL_MAX_PARAMS,
    MODEL_NUM_LAYERS,
)

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


def test_a_gemma3_decoder_layer_baseline_runs_with_its_layer_types_rotary(facts_of):
    """Gemma-3's rotary module takes the layer's type (a theta per type): the baseline
    passes it, where it once crashed (``forward() missing ... 'layer_type'``)."""
    import torch

    from kb_nano.operators.layers import DecoderLayer

    op = operators.get("decoder_layer")
    args = op.init_args(facts_of("gemma3-4b", hf_config=True), 4)
    layer = DecoderLayer(**args)
    out = layer(torch.randn(3, args["config"]["hidden_size"]), torch.arange(3))
    assert out.shape == (3, args["config"]["hidden_size"]) and torch.isfinite(out).all()
