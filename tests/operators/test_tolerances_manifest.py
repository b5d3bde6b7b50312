"""Tolerances resolve as documented (per class, config over operator, integers exactly) and the
manifest of the newer operators: variant ids, determinism, context lengths, registration.
"""

from __future__ import annotations

import pytest
import torch
from workflow_helpers import REPO

from kb_nano import operators
from kb_nano.kernels.compare import compare, tolerance
from kb_nano.kernels.manifest import dumps, generate
from kb_nano.operators.base import TOLERANCES, tolerance_for

NEW = ("gelu_and_mul", "qk_norm", "lm_head", "sampler", "attention", "mlp", "fused_moe")


# --------------------------------------------------------------------------- tolerances


def test_tolerance_classes():
    by_op = {name: operators.get(name).tolerance for name in operators.names()}
    for name in (
        "rms_norm",
        "fused_add_rms_norm",
        "qk_norm",
        "silu_and_mul",
        "gelu_and_mul",
        "embedding",
    ):
        assert by_op[name] == TOLERANCES["pointwise"], name
    assert by_op["rotary_embedding"] == TOLERANCES["rotary"]  # the baseline's own bf16 error (base.py)
    assert by_op["lm_head"] == TOLERANCES["gemm"]
    for name in ("mlp", "fused_moe"):
        assert by_op[name] == TOLERANCES["fused"], name
    assert by_op["attention"] == TOLERANCES["attention"]
    assert by_op["sampler"] == TOLERANCES["exact"]
    assert tolerance_for(operators.get("attention"), "bfloat16") == (1.2e-1, 1.6e-2)
    assert tolerance_for(operators.get("rms_norm"), "float32") == (1e-5, 1e-5)
    for table in TOLERANCES.values():  # looser for fewer mantissa bits
        assert table["float32"] <= table["float16"] <= table["bfloat16"]


def test_tolerance_rule_config_overrides_operator():
    scenario = {"target": "attention", "dtype": "bfloat16", "atol": 0.02, "rtol": 0.01}
    assert tolerance(scenario, {"atol": None, "rtol": None}) == (0.02, 0.01)
    assert tolerance(scenario, {"atol": 0.5, "rtol": None}) == (0.5, 0.01)
    assert tolerance(scenario, {"atol": 0.001, "rtol": 0.0}) == (0.001, 0.0)
    # a manifest without recorded tolerances falls back to the operator table
    assert tolerance({"target": "rms_norm", "dtype": "float32"}, {}) == (1e-5, 1e-5)


def test_compare_integer_outputs_exactly():
    ref = torch.tensor([5, 100000, 7])
    assert compare(ref, ref.clone(), 0.01, 0.01)[0] == "passed"
    status, error, *_ = compare(ref, torch.tensor([5, 100001, 7]), 1.0, 0.5)  # would pass allclose
    assert status == "incorrect" and "1 of 3" in error


# --------------------------------------------------------------------------- manifest


def test_manifest_variants_ids_and_determinism():
    kw = dict(models=["llama32-1b", "gemma2-2b"], tps=[1, 2], num_tokens=[1, 8], dtype="auto", root=REPO)
    m = generate(**kw, context_lens=[64, 256])
    ids = [s["scenario_id"] for s in m["scenarios"]]
    assert len(ids) == len(set(ids))
    attn = [i for i in ids if i.startswith("attention__llama32-1b__tp1")]
    assert attn == [
        "attention__llama32-1b__tp1__n1",
        "attention__llama32-1b__tp1__n1__ctx64",
        "attention__llama32-1b__tp1__n1__ctx256",
        "attention__llama32-1b__tp1__n8",
        "attention__llama32-1b__tp1__n8__ctx64",
        "attention__llama32-1b__tp1__n8__ctx256",
    ]
    by_id = {s["scenario_id"]: s for s in m["scenarios"]}
    dec = by_id["attention__llama32-1b__tp2__n8__ctx256"]
    assert dec["variant"] == "ctx256" and dec["context_len"] == 256
    assert {i["name"]: i["shape"] for i in dec["inputs"]}["key_cache"] == [8, 256, 4, 64]
    assert "variant" not in by_id["attention__llama32-1b__tp2__n8"]
    # gemma-2-2b is float32: the scenarios and their tolerances follow
    g = by_id["attention__gemma2-2b__tp1__n8__full"]  # (and __sliding4096: the model's layer kinds)
    assert g["dtype"] == "float32" and (g["atol"], g["rtol"]) == (1e-4, 1e-4)
    assert g["init_args"]["logits_soft_cap"] == 50.0
    assert by_id["gelu_and_mul__gemma2-2b__tp2__n8"]["applicable"] is True
    assert by_id["gelu_and_mul__llama32-1b__tp2__n8"]["reason"] == "LlamaForCausalLM does not use gelu_and_mul"
    assert by_id["fused_moe__llama32-1b__tp1__n1"]["applicable"] is False
    assert dumps(generate(**kw, context_lens=[64, 256])) == dumps(m)
    default = generate(**kw)
    assert "attention__llama32-1b__tp1__n1__ctx256" in {s["scenario_id"] for s in default["scenarios"]}


def test_manifest_context_len_not_applicable_and_duplicates():
    from kb_nano.errors import KbNanoError

    m = generate(["gemma2-2b"], [1], [1], "auto", REPO, context_lens=[8192])  # max_position_embeddings 8192
    sc = {s["scenario_id"]: s for s in m["scenarios"]}["attention__gemma2-2b__tp1__n1__ctx8192__full"]
    assert sc["applicable"] is False and "max_position_embeddings=8192" in sc["reason"]
    with pytest.raises(KbNanoError, match="context_lens: 64 listed more than once"):
        generate(["gemma2-2b"], [1], [1], "auto", REPO, context_lens=[64, 64])


def test_new_targets_registered():
    levels = {name: operators.CATALOG[name].level for name in NEW}
    assert levels == {
        "gelu_and_mul": 1,
        "qk_norm": 1,
        "lm_head": 1,
        "sampler": 1,
        "attention": 2,
        "mlp": 2,
        "fused_moe": 2,
    }
    for name in NEW:
        op = operators.get(name)
        assert (op.name, op.level, op.category) == (
            name,
            operators.CATALOG[name].level,
            operators.CATALOG[name].category,
        )
        assert op.used_in
