"""Each operator's init-args / inputs rules give the per-rank (TP) shapes; the catalog and seeded
inputs."""

from __future__ import annotations

import json

import pytest
import torch
from operator_helpers import gen

from kb_nano import operators
from kb_nano.errors import KbNanoError
from kb_nano.operators.base import (
    DTYPES,
    NotApplicable,
    kv_heads_per_rank,
    make_tensor,
    shard,
)

# --------------------------------------------------------------------------- operator rules


def _shapes(op_name, facts, tp, n=4, dtype="bfloat16"):
    op = operators.get(op_name)
    args = op.init_args(facts, tp)
    return args, {s["name"]: s["shape"] for s in op.inputs(args, facts, tp, n, dtype)}


def test_rules_llama31_8b_tp4_per_rank_shapes(facts_of):
    facts = facts_of("llama31-8b")
    assert (facts["hidden_size"], facts["num_attention_heads"], facts["num_key_value_heads"]) == (4096, 32, 8)
    for name in ("rms_norm", "fused_add_rms_norm"):
        args, shapes = _shapes(name, facts, 4)
        assert args["hidden_size"] == 4096  # replicated, never divided
        assert all(shape == [4, 4096] for shape in shapes.values())
    _, shapes = _shapes("silu_and_mul", facts, 4)
    assert shapes == {"x": [4, 2 * 14336 // 4]}
    args, shapes = _shapes("rotary_embedding", facts, 4)
    assert shapes == {"positions": [4], "query": [4, 8 * 128], "key": [4, 2 * 128]}
    args, shapes = _shapes("embedding", facts, 4)
    assert args == {"num_embeddings": 128256, "embedding_dim": 4096, "tp_size": 4, "tp_rank": 0}
    assert shapes == {"input_": [4]}
    # tp=1: nothing divided
    _, shapes = _shapes("rotary_embedding", facts, 1)
    assert shapes["query"] == [4, 32 * 128] and shapes["key"] == [4, 8 * 128]
    _, shapes = _shapes("silu_and_mul", facts, 1)
    assert shapes == {"x": [4, 2 * 14336]}


def test_rules_input_specs_are_complete(facts_of):
    facts = facts_of("llama31-8b")
    for name in operators.names():
        op = operators.get(name)
        if not op.applies_to(facts):  # fused_moe: a dense model has no experts to shape
            continue
        try:
            args = op.init_args(facts, 2)
        except NotApplicable:  # e.g. `model` is measured at tp=1 only
            continue
        specs = op.inputs(args, facts, 2, 3, "bfloat16")
        for spec in specs:
            assert set(spec) == {"name", "shape", "dtype", "init"}
            assert spec["dtype"] in DTYPES
            assert spec["shape"][0] == 3
        nbytes, flops = op.traffic(args, specs, "bfloat16")
        assert isinstance(nbytes, int) and nbytes > 0 and isinstance(flops, int) and flops >= 0
        json.dumps(args)  # manifest-serialisable


def test_rules_tp_not_dividing_heads_is_not_applicable(facts_of):
    facts = facts_of("qwen25-7b")
    assert facts["num_attention_heads"] == 28
    with pytest.raises(NotApplicable) as exc:
        operators.get("rotary_embedding").init_args(facts, 8)
    assert "num_attention_heads" in str(exc.value) and "tp=8" in str(exc.value)
    # intermediate 18944 divides by 8, so silu_and_mul still applies; by 3 it does not
    operators.get("silu_and_mul").init_args(facts, 8)
    with pytest.raises(NotApplicable, match="intermediate_size"):
        operators.get("silu_and_mul").init_args(facts, 3)


def test_rules_kv_heads_replicate_when_tp_exceeds_them(facts_of):
    facts = facts_of("qwen3-30b-a3b")  # 32 heads, 4 kv heads
    _, shapes = _shapes("rotary_embedding", facts, 8)
    assert shapes["query"] == [4, 4 * 128] and shapes["key"] == [4, 1 * 128]
    facts = facts_of("llama31-8b")  # 8 kv heads, tp 16
    _, shapes = _shapes("rotary_embedding", facts, 16)
    assert shapes["query"] == [4, 2 * 128] and shapes["key"] == [4, 128]
    assert kv_heads_per_rank(8, 1) == 8 and kv_heads_per_rank(8, 4) == 2 and kv_heads_per_rank(8, 8) == 1
    assert kv_heads_per_rank(4, 8) == 1 and kv_heads_per_rank(2, 16) == 1
    with pytest.raises(NotApplicable, match="num_key_value_heads"):
        kv_heads_per_rank(8, 12)
    with pytest.raises(NotApplicable, match="num_key_value_heads"):
        kv_heads_per_rank(8, 6)  # tp < kv heads but does not divide them


def test_rules_embedding_tp_must_divide_padded_vocab(facts_of):
    facts = {**facts_of("mixtral-8x7b")}
    assert facts["vocab_size"] == 32000
    operators.get("embedding").init_args(facts, 8)
    with pytest.raises(NotApplicable, match="vocab_size"):
        operators.get("embedding").init_args(facts, 3)


def test_rules_applies_to(facts_of):
    facts = facts_of("llama31-8b")
    assert operators.get("silu_and_mul").applies_to(facts)
    assert not operators.get("silu_and_mul").applies_to({**facts, "hidden_act": "gelu"})


def test_shard():
    assert shard(14336, 4, "intermediate_size") == 3584
    with pytest.raises(NotApplicable, match=r"tp=3 does not divide intermediate_size=14336"):
        shard(14336, 3, "intermediate_size")


def test_catalog():
    level1 = [n for n in operators.names() if operators.CATALOG[n].level == 1]
    assert level1[:2] == ["rms_norm", "fused_add_rms_norm"]
    assert {"silu_and_mul", "rotary_embedding", "embedding"} <= set(level1)
    for name in operators.names():
        op = operators.get(name)
        entry = operators.CATALOG[name]
        assert (op.name, op.level, op.category) == (name, entry.level, entry.category)
    with pytest.raises(KbNanoError) as exc:
        operators.get("flash_attn")
    assert "flash_attn" in str(exc.value) and "\n" not in str(exc.value)


def test_make_tensor_is_seeded_and_typed():
    spec = {"name": "x", "shape": [3, 4], "dtype": "bfloat16", "init": {"dist": "normal", "std": 2.0}}
    a, b = make_tensor(spec, gen(5), "cpu"), make_tensor(spec, gen(5), "cpu")
    assert a.dtype == torch.bfloat16 and a.shape == (3, 4) and torch.equal(a, b)
    ids = make_tensor(
        {"name": "i", "shape": [100], "dtype": "int64", "init": {"dist": "randint", "low": 3, "high": 7}}, gen(0), "cpu"
    )
    assert ids.dtype == torch.int64 and int(ids.min()) >= 3 and int(ids.max()) < 7
    with pytest.raises(ValueError, match="laplace"):
        make_tensor({"name": "x", "shape": [1], "dtype": "float32", "init": {"dist": "laplace"}}, gen(0), "cpu")
