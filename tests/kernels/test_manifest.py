"""kb_nano.kernels.manifest.generate on the vendored configs: ids, shapes, determinism, errors."""

from __future__ import annotations

import json

import pytest
import yaml
from workflow_helpers import REPO

from kb_nano import operators
from kb_nano.errors import KbNanoError
from kb_nano.kernels.manifest import (
    SCHEMA_VERSION,
    dumps,
    generate,
    load,
    scenario_id,
    scenario_json,
    write,
)

L1_L2 = {
    "rms_norm",
    "fused_add_rms_norm",
    "qk_norm",
    "silu_and_mul",
    "gelu_and_mul",
    "rotary_embedding",
    "embedding",
    "lm_head",
    "sampler",
    "attention",
    "mlp",
    "fused_moe",
}
MODELS = ["llama31-8b", "qwen25-7b"]
TPS = [1, 4, 8]
NUM_TOKENS = [1, 64]


@pytest.fixture(scope="module")
def manifest():
    return generate(MODELS, TPS, NUM_TOKENS, "auto", REPO)


def by_id(manifest) -> dict:
    return {s["scenario_id"]: s for s in manifest["scenarios"]}


def test_top_level(manifest):
    assert manifest["schema_version"] == SCHEMA_VERSION
    assert list(manifest["models"]) == MODELS
    m = manifest["models"]["llama31-8b"]
    assert m["hub_id"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert m["config_path"] == "config/models/meta-llama/Llama-3.1-8B-Instruct/config.json"
    assert len(m["config_sha256"]) == 64
    assert m["hidden_size"] == 4096


def test_scenario_ids_stable_and_unique(manifest, facts_of):
    assert scenario_id("rms_norm", "llama31-8b", 4, 64) == "rms_norm__llama31-8b__tp4__n64"
    ids = [s["scenario_id"] for s in manifest["scenarios"]]
    variants = {
        m: sum(len(operators.get(n).variants(facts_of(m), {"context_lens": None})) for n in operators.names())
        for m in MODELS
    }
    assert len(ids) == len(set(ids)) == sum(variants.values()) * len(TPS) * len(NUM_TOKENS)
    # order: model, operator (catalog order), tp, num_tokens
    assert ids[:4] == [
        "rms_norm__llama31-8b__tp1__n1",
        "rms_norm__llama31-8b__tp1__n64",
        "rms_norm__llama31-8b__tp4__n1",
        "rms_norm__llama31-8b__tp4__n64",
    ]
    for s in manifest["scenarios"]:
        assert s["scenario_id"] == scenario_id(s["target"], s["model"], s["tp"], s["num_tokens"], s.get("variant", ""))
        entry = operators.CATALOG[s["target"]]
        assert (s["level"], s["category"]) == (entry.level, entry.category)


def test_generation_is_byte_identical(manifest, tmp_path):
    again = generate(MODELS, TPS, NUM_TOKENS, "auto", REPO)
    assert dumps(again) == dumps(manifest)
    write(manifest, tmp_path / "a.yaml")
    write(again, tmp_path / "b.yaml")
    assert (tmp_path / "a.yaml").read_bytes() == (tmp_path / "b.yaml").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.yaml", "b.yaml"]  # no temp files left


def test_write_load_roundtrip(manifest, tmp_path):
    path = tmp_path / "inputs" / "llm.yaml"
    write(manifest, path)
    assert load(path) == manifest
    assert yaml.safe_load(path.read_text()) == manifest


def test_load_errors(tmp_path):
    with pytest.raises(KbNanoError, match="generate-inputs"):
        load(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("schema_version: 999\nscenarios: []\n")
    with pytest.raises(KbNanoError, match="regenerate"):
        load(bad)
    bad.write_text("- just a list\n")
    with pytest.raises(KbNanoError):
        load(bad)


def test_dtype_auto_is_bfloat16(manifest):
    assert {s["dtype"] for s in manifest["scenarios"]} == {"bfloat16"}
    assert manifest["models"]["llama31-8b"]["dtype"] == "bfloat16"
    rope = by_id(manifest)["rotary_embedding__llama31-8b__tp1__n1"]
    assert rope["init_args"]["dtype"] == "bfloat16"
    assert {i["dtype"] for i in rope["inputs"]} == {"int64", "bfloat16"}


def test_dtype_override_reaches_inputs_and_init_args():
    m = generate(["llama32-1b"], [1], [2], "float32", REPO)
    assert {s["dtype"] for s in m["scenarios"]} == {"float32"}
    assert m["models"]["llama32-1b"]["dtype"] == "bfloat16"  # the checkpoint's, recorded as is
    rope = by_id(m)["rotary_embedding__llama32-1b__tp1__n2"]
    assert rope["init_args"]["dtype"] == "float32"  # cos/sin cache in the scenario dtype
    x = by_id(m)["rms_norm__llama32-1b__tp1__n2"]["inputs"][0]
    assert x["dtype"] == "float32"


def test_hidden_size_and_tp4_shapes(manifest):
    s = by_id(manifest)
    norm = s["rms_norm__llama31-8b__tp1__n64"]
    assert norm["applicable"] and norm["reason"] is None
    assert norm["init_args"] == {"hidden_size": 4096, "eps": 1e-5}
    assert norm["inputs"][0]["shape"] == [64, 4096]
    fused = s["fused_add_rms_norm__llama31-8b__tp1__n64"]
    assert [i["shape"] for i in fused["inputs"]] == [[64, 4096], [64, 4096]]
    reordered = by_id(generate(["llama31-8b"], [4, 1], [64], "auto", REPO, targets=["rms_norm"]))
    assert reordered["rms_norm__llama31-8b__tp1__n64"]["applicable"]  # the lowest TP, whatever --tp's order
    assert not reordered["rms_norm__llama31-8b__tp4__n64"]["applicable"]
    for tp in TPS[1:]:  # unsharded: the same call as at tp 1, measured once
        for target in ("rms_norm", "fused_add_rms_norm"):
            again = s[f"{target}__llama31-8b__tp{tp}__n64"]
            assert not again["applicable"] and "inputs" not in again
            assert again["reason"].startswith(f"same call as tp=1 ({target}__llama31-8b__tp1__n64), measured there")
    assert s["silu_and_mul__llama31-8b__tp4__n64"]["inputs"][0]["shape"] == [64, 2 * 14336 // 4]
    rope = s["rotary_embedding__llama31-8b__tp4__n64"]
    assert {i["name"]: i["shape"] for i in rope["inputs"]} == {
        "positions": [64],
        "query": [64, 32 // 4 * 128],
        "key": [64, 8 // 4 * 128],
    }
    emb = s["embedding__llama31-8b__tp4__n1"]
    assert emb["init_args"] == {"num_embeddings": 128256, "embedding_dim": 4096, "tp_size": 4, "tp_rank": 0}
    assert emb["inputs"][0]["init"] == {"dist": "randint", "low": 0, "high": 128256}
    for sc in manifest["scenarios"]:
        if sc["applicable"]:
            assert isinstance(sc["bytes_moved"], int) and sc["bytes_moved"] > 0
            assert isinstance(sc["flops"], int)


def test_rope_llama3_params_in_rotary_init_args(manifest):
    args = by_id(manifest)["rotary_embedding__llama31-8b__tp1__n1"]["init_args"]
    assert args["rope_scaling"] == {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    }
    assert args["base"] == 500000.0 and args["max_position_embeddings"] == 131072
    assert args["head_size"] == args["rotary_dim"] == 128 and args["is_neox_style"] is True
    qwen = by_id(manifest)["rotary_embedding__qwen25-7b__tp1__n1"]["init_args"]
    assert qwen["rope_scaling"] is None and qwen["base"] == 1e6


def test_not_applicable_scenarios_keep_a_reason(manifest):
    s = by_id(manifest)
    # Qwen2.5-7B has 28 attention heads: vLLM cannot deploy it at tp 8, so every operator
    # there is not applicable, with that reason (unsharded ones too)
    tp8 = [sc for sc in manifest["scenarios"] if sc["model"] == "qwen25-7b" and sc["tp"] == 8]
    assert tp8 and all(sc["applicable"] is False for sc in tp8)
    for sc in tp8:
        assert "cannot be deployed at tp=8" in sc["reason"] and "num_attention_heads=28" in sc["reason"]
        assert "init_args" not in sc and "inputs" not in sc
    # at tp 4 it applies (intermediate 18944 divides by 4)
    assert s["silu_and_mul__qwen25-7b__tp4__n1"]["applicable"] is True
    assert s["silu_and_mul__qwen25-7b__tp4__n1"]["inputs"][0]["shape"] == [1, 2 * 18944 // 4]
    assert s["rotary_embedding__qwen25-7b__tp4__n1"]["applicable"] is True
    not_applicable = [
        sc["scenario_id"]
        for sc in manifest["scenarios"]
        if not sc["applicable"]
        and sc["target"] in L1_L2
        and "does not use" not in sc["reason"]
        and not sc["reason"].startswith("same call as tp=1")
    ]
    assert not_applicable == [sc["scenario_id"] for sc in tp8 if sc["target"] in L1_L2]
    # operators the architectures do not use (Llama / Qwen2: no QK-norm, no GeGLU, no experts)
    unused = {sc["target"] for sc in manifest["scenarios"] if not sc["applicable"] and "does not use" in sc["reason"]}
    assert unused & L1_L2 == {"qk_norm", "gelu_and_mul", "fused_moe"}


def test_kv_heads_replicated_in_manifest():
    m = generate(["qwen3-30b-a3b"], [8], [1], "auto", REPO)  # 4 kv heads at tp 8
    rope = by_id(m)["rotary_embedding__qwen3-30b-a3b__tp8__n1"]
    assert {i["name"]: i["shape"] for i in rope["inputs"]} == {"positions": [1], "query": [1, 512], "key": [1, 128]}


def test_tp_not_dividing_padded_vocab_is_not_applicable():
    # 28 heads / 28, 4 KV heads replicated: deployable, but 152064 % 28 != 0
    m = generate(["qwen25-7b"], [28], [1], "auto", REPO, targets=["embedding", "rms_norm"])
    emb = by_id(m)["embedding__qwen25-7b__tp28__n1"]
    assert emb["applicable"] is False and emb["reason"] == "tp=28 does not divide padded vocab_size=152064"
    assert by_id(m)["rms_norm__qwen25-7b__tp28__n1"]["applicable"]


def test_duplicate_model(tmp_path):
    with pytest.raises(KbNanoError) as exc:
        generate(["llama31-8b", "meta-llama/Llama-3.1-8B-Instruct"], [1], [1], "auto", REPO)
    msg = str(exc.value)
    assert "llama31-8b" in msg and "more than one model has the key" in msg and "\n" not in msg
    # two local folders of the same name: one key, named with both paths and the fix
    a, b = tmp_path / "a" / "mymodel", tmp_path / "b" / "mymodel"
    for d in (a, b):
        d.mkdir(parents=True)
        (d / "config.json").write_text(
            (REPO / "config/models/meta-llama/Llama-3.2-1B-Instruct/config.json").read_text()
        )
    with pytest.raises(KbNanoError, match="key mymodel .*rename one folder"):
        generate([str(a), str(b)], [1], [1], "auto", REPO)


def test_duplicate_tp_or_num_tokens():
    with pytest.raises(KbNanoError, match="tp: 4 listed more than once"):
        generate(["llama32-1b"], [1, 4, 4], [1], "auto", REPO)
    with pytest.raises(KbNanoError, match="num_tokens: 1 listed more than once"):
        generate(["llama32-1b"], [1], [1, 1], "auto", REPO)


def test_unknown_model():
    with pytest.raises(KbNanoError, match="unknown model 'gpt5'"):
        generate(["gpt5"], [1], [1], "auto", REPO)


def test_scenario_json_is_canonical(manifest):
    s = manifest["scenarios"][0]
    text = scenario_json(s)
    assert json.loads(text) == s
    assert text == scenario_json(json.loads(text))
    assert " " not in text


def test_variant_scenarios_attention_decode():
    m = generate(["llama31-8b"], [1], [8], "auto", REPO, context_lens=[1024, 4096])
    s = by_id(m)
    assert scenario_id("attention", "llama31-8b", 1, 8, "ctx1024") == "attention__llama31-8b__tp1__n8__ctx1024"
    prefill, decode = s["attention__llama31-8b__tp1__n8"], s["attention__llama31-8b__tp1__n8__ctx1024"]
    assert "variant" not in prefill and "context_len" not in prefill
    assert (decode["variant"], decode["context_len"]) == ("ctx1024", 1024)
    assert {i["name"]: i["shape"] for i in decode["inputs"]} == {
        "query": [8, 4096],
        "key": [8, 1024],
        "value": [8, 1024],
        "key_cache": [8, 1024, 8, 128],
        "value_cache": [8, 1024, 8, 128],
    }
    assert s["attention__llama31-8b__tp1__n8__ctx4096"]["bytes_moved"] > decode["bytes_moved"]
    # variants only where an operator declares them: other ids are unchanged
    assert [i for i in s if i.startswith("rms_norm")] == ["rms_norm__llama31-8b__tp1__n8"]
    again = generate(["llama31-8b"], [1], [8], "auto", REPO, context_lens=[1024, 4096])
    assert dumps(again) == dumps(m)


def test_scenarios_record_operator_tolerance(manifest):
    s = by_id(manifest)
    assert (s["rms_norm__llama31-8b__tp1__n1"]["atol"], s["rms_norm__llama31-8b__tp1__n1"]["rtol"]) == (0.01, 0.016)
    assert (s["attention__llama31-8b__tp1__n1"]["atol"], s["attention__llama31-8b__tp1__n1"]["rtol"]) == (0.12, 0.016)
    assert (s["sampler__llama31-8b__tp1__n1"]["atol"], s["sampler__llama31-8b__tp1__n1"]["rtol"]) == (0.0, 0.0)
    m32 = generate(["llama32-1b"], [1], [2], "float32", REPO)
    assert by_id(m32)["mlp__llama32-1b__tp1__n2"]["atol"] == 1e-4


def test_floats_and_strings_survive_json_and_yaml_readers():
    m = {
        "schema_version": 1,
        "models": {"x": {"eps": 1e-05, "theta": 1e16, "scale": 1.5e-05, "neg": -2e-07}},
        "scenarios": [{"scenario_id": 'a"1e5 2e-3', "sha": "3e5c", "atol": 0.01}],
    }
    text = dumps(m)
    assert json.loads(text) == m
    assert yaml.safe_load(text) == m


def test_a_tp_the_model_cannot_be_deployed_at_makes_every_scenario_not_applicable():
    """Llama-3.1-8B has 32 attention heads: vLLM cannot run it at TP 3, so even the
    unsharded operators (rms_norm) are not applicable there, with the reason; TP 16 is
    deployable (KV heads replicated), and so is rms_norm at TP 16."""
    m = generate(["llama31-8b"], [3, 16], [1], "auto", REPO, targets=["rms_norm", "attention"])
    by_id = {s["scenario_id"]: s for s in m["scenarios"]}
    tp3 = [s for s in m["scenarios"] if s["tp"] == 3]
    assert tp3 and all(not s["applicable"] for s in tp3)
    assert all(
        "cannot be deployed at tp=3 (vLLM): tp=3 does not divide num_attention_heads=32" in s["reason"] for s in tp3
    )
    assert by_id["rms_norm__llama31-8b__tp16__n1"]["applicable"]


TINY = REPO / "config/models/meta-llama/Llama-3.2-1B-Instruct/config.json"


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("num_attention_heads", -4, "-4"),
        ("num_attention_heads", 0, "0"),
        ("hidden_size", 2048.5, "2048.5"),
        ("num_key_value_heads", "8", '"8"'),
        ("intermediate_size", True, "true"),
        ("vocab_size", -1, "-1"),
        ("head_dim", 0, "0"),
        ("num_local_experts", -8, "-8"),
    ],
)
def test_a_nonsensical_shape_field_is_one_line_naming_the_file_and_field(tmp_path, field, value, shown):
    """A config.json whose shape field is not a positive integer (an expert count: not a
    non-negative one) stops the manifest with one line, not a traceback from an operator's
    shape rule or from transformers."""
    config = json.loads(TINY.read_text())
    config[field] = value
    path = tmp_path / "bad" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    with pytest.raises(KbNanoError) as exc:
        generate([str(path.parent)], [1], [1], "auto", REPO)
    msg = str(exc.value)
    assert "\n" not in msg and str(path) in msg and f"field {field!r} is {shown}; expected" in msg, msg


def test_rotary_cache_above_the_bound_is_not_covered_and_llama4_scout_is_measured(tmp_path):
    """A max_position_embeddings whose cos/sin cache would exceed ROTARY_CACHE_MAX_BYTES makes
    rotary_embedding not covered (no job whose allocation fails as the candidate's row);
    Llama-4 Scout's 10485760 positions (2.5 GiB) stay measured."""
    from kb_nano.operators.rotary import ROTARY_CACHE_MAX_BYTES

    config = json.loads(TINY.read_text())
    config["max_position_embeddings"] = 10**12
    path = tmp_path / "huge" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    (s,) = generate([str(path.parent)], [1], [1], "auto", REPO, targets=["rotary_embedding"])["scenarios"]
    assert s["applicable"] is False and s["reason"].startswith("not covered: the cos/sin cache"), s
    assert "max_position_embeddings=1000000000000" in s["reason"] and "8 GiB" in s["reason"]
    (scout,) = generate(["llama4-scout"], [8], [1], "auto", REPO, targets=["rotary_embedding"])["scenarios"]
    assert scout["applicable"] is True and scout["init_args"]["max_position_embeddings"] == 10485760
    assert 10485760 * scout["init_args"]["rotary_dim"] * 2 < ROTARY_CACHE_MAX_BYTES
